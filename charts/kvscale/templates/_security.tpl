{{/* Written by `make deploy-render` (`kvscale operator render-router --helm-security`) from
operator/children/pod_parts.py: edit that, not this file. Restricted Pod Security. */}}
{{- define "kvscale.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvscale.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
  - ALL
{{- end -}}
