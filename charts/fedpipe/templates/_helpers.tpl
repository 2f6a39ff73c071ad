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

{{/* The fedpipe image: repository:tag[-cuda], or repository@digest when a digest is given. */}}
{{- define "fedpipe.image" -}}
{{- $image := .Values.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- include "fedpipe.taskImage" (dict "ctx" . "flavor" $image.flavor) }}
{{- end }}
{{- end }}

{{/* Image of the pipeline's tasks by tag and flavor: (dict "ctx" $ "flavor" "cpu"|"cuda"). */}}
{{- define "fedpipe.taskImage" -}}
{{- $image := .ctx.Values.image }}
{{- $tag := default .ctx.Chart.AppVersion $image.tag }}
{{- printf "%s:%s%s" $image.repository $tag (ternary "-cuda" "" (eq .flavor "cuda")) }}
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

{{/* In-cluster URL of the chart's Pushgateway. */}}
{{- define "fedpipe.pushgatewayUrl" -}}
{{- printf "http://%s-pushgateway.%s:%d" (include "fedpipe.fullname" .) .Release.Namespace (int .Values.pushgateway.port) }}
{{- end }}

{{/* Pipeline name in the Kubeflow UI. */}}
{{- define "fedpipe.pipelineName" -}}
{{- default (printf "%s-%s" (include "fedpipe.fullname" .) (.Values.pipeline.method | replace "_" "-")) .Values.pipeline.name }}
{{- end }}

{{/* The run config as YAML: runConfig, with method.name from pipeline.method. */}}
{{- define "fedpipe.runConfig" -}}
{{- $config := deepCopy .Values.runConfig }}
{{- $method := dig "method" "name" "" $config }}
{{- if and $method (ne $method .Values.pipeline.method) }}
{{- fail (printf "runConfig.method.name (%s) differs from pipeline.method (%s): set pipeline.method only" $method .Values.pipeline.method) }}
{{- end }}
{{- $_ := set $config "method" (merge (dict "name" .Values.pipeline.method) (default (dict) $config.method)) }}
{{- toYaml $config }}
{{- end }}

{{/* A container running the fedpipe CLI in the registration Job; call with
     (dict "ctx" $ "name" "register" "args" (list ...)). */}}
{{- define "fedpipe.cliContainer" -}}
{{- $ctx := .ctx -}}
- name: {{ .name }}
  image: {{ include "fedpipe.image" $ctx | quote }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command: ["fedpipe"]
  args:
    {{- toYaml .args | nindent 4 }}
  env:
    - name: KF_PIPELINES_SA_TOKEN_PATH
      value: /var/run/secrets/kubeflow/pipelines/token
    # What the compiled pipeline's tasks get: their image, the storage endpoint, the name and keys of
    # the credentials Secret (never the credentials), and the Pushgateway.
    - name: FEDPIPE_IMAGE
      value: {{ include "fedpipe.taskImage" (dict "ctx" $ctx "flavor" $ctx.Values.image.flavor) | quote }}
    - name: FEDPIPE_TRAINING_IMAGE
      value: {{ include "fedpipe.taskImage" (dict "ctx" $ctx "flavor" $ctx.Values.image.trainingFlavor) | quote }}
    - name: FEDPIPE_S3_ENDPOINT
      value: {{ $ctx.Values.storage.endpoint | quote }}
    - name: FEDPIPE_S3_SECRET
      value: {{ include "fedpipe.storageSecretName" $ctx | quote }}
    - name: FEDPIPE_S3_SECRET_KEYS
      value: {{ printf "%s,%s" $ctx.Values.storage.accessKeyKey $ctx.Values.storage.secretKeyKey | quote }}
    {{- if $ctx.Values.pushgateway.enabled }}
    - name: FEDPIPE_PUSHGATEWAY
      value: {{ include "fedpipe.pushgatewayUrl" $ctx | quote }}
    {{- end }}
    # The kfp client writes its context under ~/.config, and the root filesystem is read-only.
    - name: HOME
      value: /tmp
  volumeMounts:
    - name: kfp-token
      mountPath: /var/run/secrets/kubeflow/pipelines
      readOnly: true
    - name: run-config
      mountPath: /etc/fedpipe
      readOnly: true
    - name: tmp
      mountPath: /tmp
  securityContext:
    {{- toYaml $ctx.Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml $ctx.Values.register.resources | nindent 4 }}
{{- end }}

{{/* Egress rules every training pod needs: name resolution, the artifact store (run state,
     checkpoints, reports) and, when the chart runs one, the Pushgateway (per-round metrics). */}}
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
{{- end }}
{{- end }}

{{/* Labels of a PyTorchJob's pods (fedpipe.pipelines.pytorchjob.labels): the distributed-phase NetworkPolicy selects them. */}}
{{- define "fedpipe.distributedPhaseLabels" -}}
app.kubernetes.io/part-of: fedpipe
app.kubernetes.io/component: distributed-phase
{{- end }}
