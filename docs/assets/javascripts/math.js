// Renders the math that pymdownx.arithmatex (generic mode) leaves in the page, <span class="arithmatex">\( ... \)</span>
// inline and <div class="arithmatex">\[ ... \]</div> displayed, with KaTeX served from the site itself
// (docs/assets/katex/, no CDN), and nothing outside those elements. Material's document$ fires on every page
// load; without it (another theme) the page's own DOMContentLoaded does.
(function () {
  function render(root) {
    var math = root.querySelectorAll(".arithmatex");
    for (var i = 0; i < math.length; i++) renderMath(math[i]);
  }
  function renderMath(element) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(function (doc) { render(doc.body); });
  } else {
    document.addEventListener("DOMContentLoaded", function () { render(document.body); });
  }
})();
