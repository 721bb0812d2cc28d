{{/* A `helm test` pod: the control-plane image's Python runs `script` (restricted Pod Security,
deleted once it passed, kept for `kubectl logs` when it failed). */}}
{{- define "kvscale.testPod" -}}
{{- $root := .root }}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "kvscale.fullname" $root }}-test-{{ .name }}
  namespace: {{ default $root.Release.Namespace $root.Values.tests.namespace }}
  labels:
    {{- include "kvscale.labels" $root | nindent 4 }}
    app.kubernetes.io/component: helm-test
  annotations:
    helm.sh/hook: test
    helm.sh/hook-weight: {{ .weight | quote }}
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
spec:
  restartPolicy: Never
  enableServiceLinks: false
  automountServiceAccountToken: false
  {{- with $root.Values.images.pullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "kvscale.podSecurityContext" $root | nindent 4 }}
  containers:
    - name: test
      image: {{ include "kvscale.image" (dict "image" $root.Values.images.controlPlane "root" $root) }}
      imagePullPolicy: {{ $root.Values.images.pullPolicy }}
      command: [python, -c]
      args:
        - {{ .script | quote }}
      env:
        - {name: KVSCALE_TEST_URL, value: {{ .url | quote }}}
      resources:
        requests: {cpu: 50m, memory: 128Mi}
        limits: {memory: 256Mi}
      securityContext:
        {{- include "kvscale.containerSecurityContext" $root | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
  volumes:
    - name: tmp
      emptyDir: {sizeLimit: 16Mi}
{{- end -}}
