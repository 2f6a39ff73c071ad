{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "fedpipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of resource names: the release name, plus the chart name unless the release name has it. */}}
{{- define "fedpipe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version for the helm.sh/chart label. */}}
{{- define "fedpipe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select a component's pods; call with (dict "ctx" $ "component" "name"). */}}
{{- define "fedpipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fedpipe.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every resource; call with (dict "ctx" $ "component" "name"). */}}
{{- define "fedpipe.labels" -}}
helm.sh/chart: {{ include "fedpipe.chart" .ctx }}
{{ include "fedpipe.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fedpipe
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Tag of the Job's image and of the pipeline's non-training tasks: image.tag, or the appVersion. */}}
{{- define "fedpipe.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* Tag of the training tasks' image: image.trainingTag, or `<tag>-cuda` (the CUDA build runs on CPU nodes too). */}}
{{- define "fedpipe.trainingImageTag" -}}
{{- default (printf "%s-cuda" (include "fedpipe.imageTag" .)) .Values.image.trainingTag }}
{{- end }}

{{/* The registration Job's image: repository:tag, or repository@digest when a digest is given. */}}
{{- define "fedpipe.image" -}}
{{- $image := .Values.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (include "fedpipe.imageTag" .) }}
{{- end }}
{{- end }}

{{/* The fedpipe containers' pull policy: image.pullPolicy, else IfNotPresent for an image pinned by digest and Always
     for one named by a tag (a tag can move: a node's cached copy of the old bytes would keep running). */}}
{{- define "fedpipe.imagePullPolicy" -}}
{{- default (ternary "IfNotPresent" "Always" (not (empty .Values.image.digest))) .Values.image.pullPolicy }}
{{- end }}

{{/* KFP namespace the pipeline and its runs belong to: kubeflow.namespace, or the release namespace. */}}
{{- define "fedpipe.kfpNamespace" -}}
{{- default .Release.Namespace .Values.kubeflow.namespace }}
{{- end }}

{{/* ServiceAccount the registration Job runs as. */}}
{{- define "fedpipe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fedpipe.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret with the S3 credentials: the one the chart creates, or the existing one. */}}
{{- define "fedpipe.storageSecretName" -}}
{{- if .Values.storage.createSecret }}
{{- printf "%s-storage" (include "fedpipe.fullname" .) }}
{{- else }}
{{- required "storage.existingSecret is required when storage.createSecret is false" .Values.storage.existingSecret }}
{{- end }}
{{- end }}

{{/* Secret with the artifact signing key (data key "key"): the existing one when named, else the one the chart creates. */}}
{{- define "fedpipe.signingSecretName" -}}
{{- if .Values.signing.existingSecret }}
{{- .Values.signing.existingSecret }}
{{- else if .Values.signing.createSecret }}
{{- printf "%s-signing" (include "fedpipe.fullname" .) }}
{{- else }}
{{- required "signing.existingSecret is required when signing.enabled is true and signing.createSecret is false" .Values.signing.existingSecret }}
{{- end }}
{{- end }}

{{/* In-cluster URL of the chart's Pushgateway. */}}
{{- define "fedpipe.pushgatewayUrl" -}}
{{- printf "http://%s-pushgateway.%s:%d" (include "fedpipe.fullname" .) .Release.Namespace (int .Values.pushgateway.port) }}
{{- end }}

{{/* The Pushgateway runs push to by default (run parameter telemetry_pushgateway): the chart's own, else
     pushgateway.url, else "" (no metrics unless a run sets the parameter). */}}
{{- define "fedpipe.pushgatewayTarget" -}}
{{- if .Values.pushgateway.enabled }}
{{- include "fedpipe.pushgatewayUrl" . }}
{{- else }}
{{- .Values.pushgateway.url }}
{{- end }}
{{- end }}

{{/* Port of pushgateway.url: the one it names, else 443 for https and 80 for http. */}}
{{- define "fedpipe.externalPushgatewayPort" -}}
{{- $url := urlParse .Values.pushgateway.url }}
{{- $hostPort := splitList ":" $url.host }}
{{- if gt (len $hostPort) 1 }}
{{- last $hostPort }}
{{- else }}
{{- ternary "443" "80" (eq $url.scheme "https") }}
{{- end }}
{{- end }}

{{/* "true" when the ServiceMonitor is rendered: enabled true, or auto on a cluster serving its API (and
     a Pushgateway to scrape); "" otherwise. */}}
{{- define "fedpipe.serviceMonitorEnabled" -}}
{{- $enabled := toString .Values.serviceMonitor.enabled }}
{{- if eq $enabled "true" }}
{{- "true" }}
{{- else if and (eq $enabled "auto") .Values.pushgateway.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}
{{- "true" }}
{{- end }}
{{- end }}

{{/* The flags of `fedpipe register` and `fedpipe schedule` that say how the pipeline is compiled and where
     it goes (after --host, --method, --name), one per line as a YAML list. */}}
{{- define "fedpipe.deployArgs" -}}
{{- $v := .Values }}
{{- $args := list
      (printf "--namespace=%s" (include "fedpipe.kfpNamespace" .))
      (printf "--image-repository=%s" $v.image.repository)
      (printf "--image-tag=%s" (include "fedpipe.imageTag" .))
      (printf "--training-image-tag=%s" (include "fedpipe.trainingImageTag" .))
      (printf "--accelerator-count=%d" (int $v.training.acceleratorCount))
      (printf "--accelerator-type=%s" $v.training.acceleratorType) }}
{{- /* --resource=cpu_request=... of the training tasks, then --resource=step_cpu_request=... of the others. */}}
{{- range $task := list (list "" $v.training.resources) (list "step_" $v.steps.resources) }}
{{- range $resource := list "cpu" "memory" }}
{{- range $bound := list "request" "limit" }}
{{- $value := index (index $task 1) (printf "%ss" $bound) $resource }}
{{- $args = append $args (printf "--resource=%s%s_%s=%s" (index $task 0) $resource $bound (toString $value)) }}
{{- end }}
{{- end }}
{{- end }}
{{- with include "fedpipe.pushgatewayTarget" . }}
{{- $args = append $args (printf "--pushgateway=%s" .) }}
{{- end }}
{{- with .Values.training.kueueQueue }}
{{- /* Kueue's LocalQueue of the GPU work (the training tasks' pods, a distributed phase's job). */}}
{{- $args = append $args (printf "--kueue-queue=%s" .) }}
{{- end }}
{{- if .Values.signing.enabled }}
{{- /* The name of the signing-key Secret only; the tasks read the key from it as FEDPIPE_SIGNING_KEY. */}}
{{- $args = append $args (printf "--signing-secret=%s" (include "fedpipe.signingSecretName" .)) }}
{{- end }}
{{- if .Values.federation.enabled }}
{{- /* Federation mode's defaults: the SuperLink's control Service, and the Secret holding only the CA certificate,
     which the federation tasks mount (the run parameter engine_mode=federation picks that branch). */}}
{{- $args = append $args (printf "--federation-superlink=%s:%d" (include "fedpipe.superlinkControlName" .) (int .Values.federation.controlPort)) }}
{{- if not .Values.federation.tls.caSecretName }}
{{- fail "federation.tls.caSecretName: name a Secret holding only ca.crt (the federation's CA certificate) for the pipeline's federation tasks to mount: not the SuperLink's own TLS Secret, whose private key a task pod must never get (`fedpipe federation certs` writes ca.secret.yaml)" }}
{{- end }}
{{- $args = append $args (printf "--federation-ca-secret=%s" .Values.federation.tls.caSecretName) }}
{{- /* The Control API's token: only the federation tasks mount it (they alone submit runs). */}}
{{- $args = append $args (printf "--federation-control-secret=%s" (include "fedpipe.superlinkControlSecret" .)) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Pipeline name in the Kubeflow UI. */}}
{{- define "fedpipe.pipelineName" -}}
{{- default (printf "%s-%s" (include "fedpipe.fullname" .) (.Values.pipeline.method | replace "_" "-")) .Values.pipeline.name }}
{{- end }}

{{/* The run config as YAML: runConfig, with method.name from pipeline.method and, with schedule.cron, the
     recurring run's defaults (schedule.retraining). */}}
{{- define "fedpipe.runConfig" -}}
{{- $config := deepCopy .Values.runConfig }}
{{- $method := dig "method" "name" "" $config }}
{{- if and $method (ne $method .Values.pipeline.method) }}
{{- fail (printf "runConfig.method.name (%s) differs from pipeline.method (%s): set pipeline.method only" $method .Values.pipeline.method) }}
{{- end }}
{{- $_ := set $config "method" (merge (dict "name" .Values.pipeline.method) (default (dict) $config.method)) }}
{{- if .Values.schedule.cron }}
{{- /* The recurring run's defaults (schedule.retraining): the newest drop, a warm start from the promoted
     version, every run a version of the model line behind the gate; a registry or train field runConfig sets wins. */}}
{{- $r := .Values.schedule.retraining }}
{{- $line := $r.line | default (include "fedpipe.pipelineName" . | lower | trunc 63 | trimSuffix "-") }}
{{- if not (regexMatch "^[a-z0-9][a-z0-9._-]{0,62}$" $line) }}
{{- fail (printf "the model line of the recurring run would be %q (the pipeline's name), which is no line name (a-z, 0-9, '.', '_', '-'): set schedule.retraining.line" $line) }}
{{- end }}
{{- $federated := eq (dig "engine" "mode" "simulation" $config) "federation" }}
{{- $gate := $r.gateMetric | default (ternary "global_accuracy" "personalized_accuracy" $federated) }}
{{- if and $federated (ne $gate "global_accuracy") }}
{{- fail (printf "schedule.retraining.gateMetric=%s with runConfig.engine.mode=federation: a federated run registers its global model only, so its gate compares global models: set schedule.retraining.gateMetric=global_accuracy (or leave it empty)" $gate) }}
{{- end }}
{{- $registry := dict "name" $line "gate_metric" $gate "tolerance" $r.tolerance "max_client_drop" $r.maxClientDrop }}
{{- $_ := set $config "registry" (merge (default (dict) $config.registry) $registry) }}
{{- $_ := set $config "train" (merge (default (dict) $config.train) (dict "init_from" $r.initFrom)) }}
{{- with $r.dataSource }}
{{- $_ := set $config "data" (merge (dict "dataset" "files" "source" .) (default (dict) $config.data)) }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* A container running the fedpipe CLI in the registration Job; call with
     (dict "ctx" $ "name" "register" "args" (list ...)), and "kfpOnly" true for a command that only talks to
     the KFP API (unschedule, check kfp): no run config, no storage settings. */}}
{{- define "fedpipe.cliContainer" -}}
{{- $ctx := .ctx -}}
- name: {{ .name }}
  image: {{ include "fedpipe.image" $ctx | quote }}
  imagePullPolicy: {{ include "fedpipe.imagePullPolicy" $ctx }}
  command: ["fedpipe"]
  args:
    {{- toYaml .args | nindent 4 }}
  env:
    - name: KF_PIPELINES_SA_TOKEN_PATH
      value: /var/run/secrets/kubeflow/pipelines/token
    {{- if not .kfpOnly }}
    # What the compiled pipeline's tasks get besides the flags: the storage endpoint and the name and keys
    # of the credentials Secret (never the credentials).
    - name: FEDPIPE_S3_ENDPOINT
      value: {{ $ctx.Values.storage.endpoint | quote }}
    - name: FEDPIPE_S3_SECRET
      value: {{ include "fedpipe.storageSecretName" $ctx | quote }}
    - name: FEDPIPE_S3_SECRET_KEYS
      value: {{ printf "%s,%s" $ctx.Values.storage.accessKeyKey $ctx.Values.storage.secretKeyKey | quote }}
    {{- end }}
    # The kfp client writes its context under ~/.config, and the root filesystem is read-only.
    - name: HOME
      value: /tmp
  volumeMounts:
    - name: kfp-token
      mountPath: /var/run/secrets/kubeflow/pipelines
      readOnly: true
    {{- if not .kfpOnly }}
    - name: run-config
      mountPath: /etc/fedpipe
      readOnly: true
    {{- end }}
    - name: tmp
      mountPath: /tmp
  securityContext:
    {{- toYaml $ctx.Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml $ctx.Values.register.resources | nindent 4 }}
{{- end }}

{{/* Egress rules every task pod needs: name resolution, the artifact store (run state, checkpoints,
     reports) and the Pushgateway (per-round metrics): the chart's own, or the one at pushgateway.url. */}}
{{- define "fedpipe.storageEgress" -}}
{{- $np := .Values.networkPolicy -}}
# Name resolution.
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ $np.dns.namespace }}
      podSelector:
        matchLabels:
          {{- toYaml $np.dns.podLabels | nindent 10 }}
  ports:
    - protocol: UDP
      port: 53
    - protocol: TCP
      port: 53
# The artifact store.
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ $np.storage.namespace }}
      podSelector:
        matchLabels:
          {{- toYaml $np.storage.podLabels | nindent 10 }}
  ports:
    - protocol: TCP
      port: {{ $np.storage.port }}
{{- if .Values.pushgateway.enabled }}
# Per-round metrics.
- to:
    - podSelector:
        matchLabels:
          {{- include "fedpipe.selectorLabels" (dict "ctx" . "component" "pushgateway") | nindent 10 }}
  ports:
    - protocol: TCP
      port: {{ .Values.pushgateway.port }}
{{- else if .Values.pushgateway.url }}
# Per-round metrics, to the external Pushgateway.
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ $np.pushgateway.namespace }}
      podSelector:
        matchLabels:
          {{- toYaml $np.pushgateway.podLabels | nindent 10 }}
  ports:
    - protocol: TCP
      port: {{ include "fedpipe.externalPushgatewayPort" . | int }}
{{- end }}
{{- end }}

{{/* Labels of a PyTorchJob's or TrainJob's pods (fedpipe.k8s.phasejob.labels; a TrainJob puts them on its pods
through podTemplateOverrides): the distributed-phase NetworkPolicy selects them. */}}
{{- define "fedpipe.distributedPhaseLabels" -}}
app.kubernetes.io/part-of: fedpipe
app.kubernetes.io/component: distributed-phase
{{- end }}

{{/* The API a distributed phase runs on: pytorchJob.api, where auto is trainjob when the cluster serves Kubeflow
Trainer v2's TrainJob (Kubeflow 1.11+; `helm template --api-versions trainer.kubeflow.org/v1alpha1/TrainJob`), else
pytorchjob (the Training Operator's PyTorchJob). */}}
{{- define "fedpipe.jobApi" -}}
{{- $api := .Values.pytorchJob.api | default "auto" -}}
{{- /* Where both are served (Kubeflow 1.11, 26.03) the PyTorchJob stays: its pods carry fedpipe's
     security context, which a TrainJob cannot set (trainer v2.1.0 trainjob_types.go; only its runtime can). */ -}}
{{- if ne $api "auto" -}}
{{- $api -}}
{{- else if and (.Capabilities.APIVersions.Has "trainer.kubeflow.org/v1alpha1/TrainJob") (not (.Capabilities.APIVersions.Has "kubeflow.org/v1/PyTorchJob")) -}}
trainjob
{{- else -}}
pytorchjob
{{- end -}}
{{- end }}

{{/* `fedpipe unschedule` of the recurring run `fedpipe schedule` makes (`<pipeline name>-schedule` in
     schedule.experiment), as a YAML list: the uninstall hook's and, without schedule.cron, the registration
     Job's first step, so that no recurring run outlives the release or its cron. */}}
{{- define "fedpipe.unscheduleArgs" -}}
{{- $args := list "unschedule" (printf "--host=%s" .Values.kubeflow.host) (printf "--name=%s" (include "fedpipe.pipelineName" .)) (printf "--namespace=%s" (include "fedpipe.kfpNamespace" .)) }}
{{- with .Values.schedule.experiment }}
{{- $args = append $args (printf "--experiment=%s" .) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* The projected token the KFP API server accepts (audience pipelines.kubeflow.org), as a pod volume. */}}
{{- define "fedpipe.kfpTokenVolume" -}}
- name: kfp-token
  projected:
    sources:
      - serviceAccountToken:
          path: token
          audience: {{ .Values.kubeflow.tokenAudience }}
          expirationSeconds: {{ .Values.kubeflow.tokenExpirationSeconds }}
{{- end }}

{{/* Labels of a `helm test` pod that stands in for a fedpipe task pod: the chart's (with the pipeline's
     app.kubernetes.io/part-of: fedpipe, builder.POD_LABEL) and KFP's own, so that the training NetworkPolicy
     selects it as it selects the tasks; call with (dict "ctx" $ "component" "name"). */}}
{{- define "fedpipe.taskPodLabels" -}}
{{- toYaml (merge (dict "pipelines.kubeflow.org/v2_component" "true") (include "fedpipe.labels" . | fromYaml)) }}
{{- end }}

{{/* "true" when the PrometheusRule is rendered: alerts.enabled true, or auto where the cluster serves the
     Prometheus Operator's PrometheusRule API and the chart runs the Pushgateway the rules read. */}}
{{- define "fedpipe.alertsEnabled" -}}
{{- $enabled := toString .Values.alerts.enabled }}
{{- if eq $enabled "true" }}
{{- "true" }}
{{- else if and (eq $enabled "auto") .Values.pushgateway.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule") }}
{{- "true" }}
{{- end }}
{{- end }}

{{/* "true" when the ValidatingAdmissionPolicy that narrows the launcher's Role is rendered: with pytorchJob.enabled,
     pytorchJob.admissionPolicy.enabled true, or auto where the cluster serves admissionregistration.k8s.io/v1
     ValidatingAdmissionPolicy (GA in Kubernetes 1.30); "" otherwise. */}}
{{- define "fedpipe.admissionPolicyEnabled" -}}
{{- $enabled := toString .Values.pytorchJob.admissionPolicy.enabled }}
{{- if not .Values.pytorchJob.enabled }}
{{- else if eq $enabled "true" }}
{{- "true" }}
{{- else if and (eq $enabled "auto") (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") }}
{{- "true" }}
{{- end }}
{{- end }}

{{/* The federation's SuperLink (federation.enabled): name of its Deployment and fleet Service. It lives in the
     namespace of the runs (fedpipe.kfpNamespace), where the storage and signing Secrets its ServerApps read are. */}}
{{- define "fedpipe.superlinkName" -}}
{{- printf "%s-superlink" (include "fedpipe.fullname" . | trunc 53 | trimSuffix "-") }}
{{- end }}

{{/* The ClusterIP Service of the SuperLink's Control API port (the pipeline's task pods, operators). */}}
{{- define "fedpipe.superlinkControlName" -}}
{{- printf "%s-superlink-control" (include "fedpipe.fullname" . | trunc 45 | trimSuffix "-") }}
{{- end }}

{{/* The run store the pipeline's runs use (pipelines/builder.py `_deployed`: runConfig.run.store when it is s3://, else
     DeployOptions.store's default), and so the only one the SuperLink's ServerApps may write to. */}}
{{- define "fedpipe.runStore" -}}
{{- $store := toString (dig "run" "store" "" .Values.runConfig) }}
{{- ternary $store "s3://mlpipeline/fedpipe" (hasPrefix "s3://" $store) }}
{{- end }}

{{/* The Secret whose `token` the SuperLink's Control API asks of every call: federation.controlToken.existingSecret,
     else the one the chart creates (superlink-control-secret.yaml). */}}
{{- define "fedpipe.superlinkControlSecret" -}}
{{- default (printf "%s-token" (include "fedpipe.superlinkControlName" .)) .Values.federation.controlToken.existingSecret }}
{{- end }}

{{/* The Secret with the SuperLink's tls.crt, tls.key and ca.crt: federation.tls.secretName, or the one cert-manager
     writes with federation.tls.certManager.enabled; exactly one of the two, else the render fails naming both. */}}
{{- define "fedpipe.superlinkTlsSecret" -}}
{{- $tls := .Values.federation.tls }}
{{- if and $tls.secretName $tls.certManager.enabled }}
{{- fail "federation.tls: name exactly one of federation.tls.secretName (an existing Secret with tls.crt, tls.key and ca.crt) and federation.tls.certManager.enabled (cert-manager issues it), not both" }}
{{- else if $tls.secretName }}
{{- $tls.secretName }}
{{- else if $tls.certManager.enabled }}
{{- if not $tls.certManager.issuerRef.name }}
{{- fail "federation.tls.certManager.issuerRef.name: federation.tls.certManager.enabled needs the Issuer (or ClusterIssuer) of a private CA that signs the SuperLink's certificate" }}
{{- end }}
{{- default (printf "%s-tls" (include "fedpipe.superlinkName" .)) $tls.certManager.secretName }}
{{- else }}
{{- fail "federation.tls: name exactly one of federation.tls.secretName (an existing Secret with tls.crt, tls.key and ca.crt) and federation.tls.certManager.enabled (cert-manager issues it): the SuperLink serves TLS only (SuperNode authentication needs it)" }}
{{- end }}
{{- end }}

{{/* DNS names the SuperLink's certificate must hold, as a YAML list: the fleet and control Services' in-cluster names
     (the filter verifies the SuperLink by the fleet Service's .svc name), then federation.tls.extraDnsNames. */}}
{{- define "fedpipe.superlinkDnsNames" -}}
{{- $ns := include "fedpipe.kfpNamespace" . }}
{{- $names := list }}
{{- range $service := list (include "fedpipe.superlinkName" .) (include "fedpipe.superlinkControlName" .) }}
{{- $names = concat $names (list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns)) }}
{{- end }}
{{- toYaml (concat $names .Values.federation.tls.extraDnsNames | uniq) }}
{{- end }}

{{/* The name the filter checks the SuperLink's certificate for on 127.0.0.1 (nginx's proxy_ssl_name: a DNS name,
     nginx 1.22 matches no IP address entries). */}}
{{- define "fedpipe.superlinkUpstreamName" -}}
{{- printf "%s.%s.svc" (include "fedpipe.superlinkName" .) (include "fedpipe.kfpNamespace" .) }}
{{- end }}
