{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "site.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of resource names: the release name, plus the chart name unless the release name has it. */}}
{{- define "site.fullname" -}}
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

{{/* Labels that select this release's pods (the SuperNode and the helm test pod: one NetworkPolicy for both). */}}
{{- define "site.selectorLabels" -}}
app.kubernetes.io/name: {{ include "site.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource; call with (dict "ctx" $ "component" "name"). */}}
{{- define "site.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "site.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fedpipe
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The image: repository:tag, or repository@digest. */}}
{{- define "site.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* imagePullPolicy: the value, else Always for a tag (it can move) and IfNotPresent for a digest. */}}
{{- define "site.pullPolicy" -}}
{{- default (ternary "IfNotPresent" "Always" (not (empty .Values.image.digest))) .Values.image.pullPolicy }}
{{- end }}

{{/* The site's data as `fedpipe site` takes it (--data): the folder in the read-only volume, or the S3 URL; and the
     checks of the values that the schema cannot express across fields. */}}
{{- define "site.dataArg" -}}
{{- $d := .Values.data }}
{{- if eq $d.source "s3" }}
{{- if not $d.s3.url }}{{ fail "data.s3.url: data.source=s3 needs the site's files as s3://bucket/prefix" }}{{ end }}
{{- if not $d.s3.secretName }}{{ fail "data.s3.secretName: data.source=s3 needs the Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" }}{{ end }}
{{- $d.s3.url }}
{{- else }}
{{- if eq (empty $d.volume.claimName) (empty $d.volume.hostPath) }}{{ fail "data.volume: name exactly one of data.volume.claimName (a PVC) and data.volume.hostPath (a node's folder) for data.source=volume" }}{{ end }}
{{- printf "/data/%s" (trimPrefix "/" $d.path) | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* The volumes both pods mount: the CA, the site's key, and the data volume (source=volume). */}}
{{- define "site.volumes" -}}
- name: policy
  configMap:
    name: {{ include "site.fullname" . }}-policy
- name: ca
  secret:
    secretName: {{ required "superlink.caSecret.name: the Secret with the federation's CA certificate" .Values.superlink.caSecret.name }}
    items:
      - key: {{ .Values.superlink.caSecret.key }}
        path: ca.crt
- name: site-key
  secret:
    secretName: {{ required "siteKey.secretName: the Secret with this site's private key (fedpipe site keygen)" .Values.siteKey.secretName }}
    # readable by the pod's group (fsGroup) only: the key never leaves the site
    defaultMode: 0440
    items:
      - key: {{ .Values.siteKey.key }}
        path: site.key
{{- if eq .Values.data.source "volume" }}
- name: data
  {{- if .Values.data.volume.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.data.volume.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ .Values.data.volume.hostPath }}
    type: Directory
  {{- end }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{/* The mounts of those volumes. */}}
{{- define "site.volumeMounts" -}}
- name: ca
  mountPath: /etc/fedpipe/ca
  readOnly: true
- name: policy
  mountPath: /etc/fedpipe/policy
  readOnly: true
- name: site-key
  mountPath: /etc/fedpipe/key
  readOnly: true
{{- if eq .Values.data.source "volume" }}
- name: data
  mountPath: /data
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Environment of both pods: Flower's home in /tmp (the root is read-only), and the S3 credentials for source=s3. */}}
{{- define "site.env" -}}
- name: HOME
  value: /tmp
- name: FLWR_HOME
  value: /tmp/flwr
- name: FLWR_TELEMETRY_ENABLED
  value: "0"
{{- if eq .Values.data.source "s3" }}
{{- with .Values.data.s3.endpoint }}
- name: FEDPIPE_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.data.s3.secretName }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.data.s3.secretName }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}

{{/* The CLI's arguments both commands share (site join, site check). */}}
{{- define "site.commonArgs" -}}
- --data
- {{ include "site.dataArg" . | quote }}
- --superlink
- {{ required "superlink.address: the SuperLink's fleet API, host:port" .Values.superlink.address | quote }}
- --root-certificates
- /etc/fedpipe/ca/ca.crt
- --key
- /etc/fedpipe/key/site.key
{{- with .Values.data.imageSize }}
- --image-size
- {{ . | quote }}
{{- end }}
- --policy
- /etc/fedpipe/policy/policy.yaml
{{- end }}
