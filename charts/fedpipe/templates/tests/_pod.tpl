{{/* A `helm test` pod running one `fedpipe check` command in the fedpipe image. Call with (dict "ctx" $
     "name" "pushgateway" "labels" (YAML) "annotations" (dict) "args" (list) "env" (list of EnvVar) and,
     for the KFP check, "kfpToken" true, which runs it as the chart's ServiceAccount with the projected KFP
     token). Outside Istio's mesh (the caller's annotations say so): a classic sidecar never exits, and
     `helm test` waits for the pod to finish. */}}
{{- define "fedpipe.testPod" -}}
{{- $ctx := .ctx -}}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "fedpipe.fullname" $ctx }}-test-{{ .name }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- .labels | nindent 4 }}
  annotations:
    helm.sh/hook: test
    # Kept after it ran (`helm test --logs`, kubectl logs); the next `helm test` replaces it.
    helm.sh/hook-delete-policy: before-hook-creation
    {{- with .annotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  restartPolicy: Never
  {{- if .kfpToken }}
  serviceAccountName: {{ include "fedpipe.serviceAccountName" $ctx }}
  {{- end }}
  # No Kubernetes API token: the checks talk to KFP (with the projected token), the store and the Pushgateway.
  automountServiceAccountToken: false
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $ctx.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: check
      image: {{ include "fedpipe.image" $ctx | quote }}
      imagePullPolicy: {{ include "fedpipe.imagePullPolicy" $ctx }}
      command: ["fedpipe"]
      args:
        {{- toYaml .args | nindent 8 }}
      env:
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- if .kfpToken }}
        - name: KF_PIPELINES_SA_TOKEN_PATH
          value: /var/run/secrets/kubeflow/pipelines/token
        {{- end }}
        # The kfp client and Python write under ~ and /tmp; the root filesystem is read-only.
        - name: HOME
          value: /tmp
      volumeMounts:
        {{- if .kfpToken }}
        - name: kfp-token
          mountPath: /var/run/secrets/kubeflow/pipelines
          readOnly: true
        {{- end }}
        - name: tmp
          mountPath: /tmp
      securityContext:
        {{- toYaml $ctx.Values.containerSecurityContext | nindent 8 }}
      resources:
        {{- toYaml $ctx.Values.tests.resources | nindent 8 }}
  volumes:
    {{- if .kfpToken }}
    {{- include "fedpipe.kfpTokenVolume" $ctx | nindent 4 }}
    {{- end }}
    - name: tmp
      emptyDir: {}
{{- end }}
