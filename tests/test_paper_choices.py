"""`fedpipe methods` says, per method, which defaults depart from its paper (docs/faithfulness.md has
the equations and the reasons); each choice's own test sits with its method's tests."""

from typer.testing import CliRunner

from fedpipe.cli import app


def test_methods_command_names_the_defaults_that_depart_from_the_papers():
    out = CliRunner().invoke(app, ["methods"])
    assert out.exit_code == 0, out.output
    blocks, name = {}, None
    for line in out.output.splitlines():
        if not line.startswith(" "):
            name = line.split()[0]
            blocks[name] = []
        else:
            blocks[name].append(line.strip())
    fedamp = " ".join(blocks["fedamp"])
    assert "step=capped" in fedamp and "min_self_weight=0.5" in fedamp and "step=fixed" in fedamp
    fedmoe = " ".join(blocks["fedmoe"])
    assert "Adam" in fedmoe and "train.optimizer=adam" in fedmoe and "patience" in fedmoe
    assert any("branch_init=centred" in line for line in blocks["pfedmb"])
    assert not any("alpha_step" in line for line in blocks["pfedmb"])  # Eq. 3's plain step is the default now
    assert not any("weighting" in line for line in blocks["ifca"])  # Algorithm 2's uniform mean is the default now
    assert all(lines for lines in blocks.values())  # every method has a line about its defaults


def test_every_method_lists_its_departures():
    from fedpipe.algorithms import ALGORITHMS

    missing = [n for n, cls in ALGORITHMS.items() if cls.departures is None]
    assert not missing, f"no `departures` tuple: {missing}"
    for name, cls in ALGORITHMS.items():
        assert isinstance(cls.departures, tuple) and all(isinstance(s, str) and s for s in cls.departures), name
    out = CliRunner().invoke(app, ["methods"])
    assert out.exit_code == 0, out.output
    assert "not listed here yet" not in out.output
