{{/* Names: "kvscale" for a release named kvscale (what deploy/*.yaml is rendered with), else
"<release>-kvscale", cut to 63 characters as Kubernetes names must be. */}}
{{- define "kvscale.fullname" -}}
{{- if contains "kvscale" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvscale" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvscale.operator.name" -}}
{{- printf "%s-operator" (include "kvscale.fullname" .) -}}
{{- end -}}

{{- define "kvscale.serviceAccountName" -}}
{{- default (include "kvscale.operator.name" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvscale.router.name" -}}
{{- printf "%s-router" (include "kvscale.fullname" .) -}}
{{- end -}}

{{- define "kvscale.router.namespace" -}}
{{- default .Release.Namespace .Values.namespaceRouter.namespace -}}
{{- end -}}

{{/* Labels every object of the chart carries. */}}
{{- define "kvscale.labels" -}}
app.kubernetes.io/name: kvscale
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvscale
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvscale.operator.selectorLabels" -}}
app.kubernetes.io/name: kvscale
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvscale.router.selectorLabels" -}}
app.kubernetes.io/name: kvscale
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: namespace-router
{{- end -}}

{{/* An image reference: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "kvscale.image" -}}
{{- if eq .image.tag "latest" -}}
{{- fail (printf "images: %s:latest is refused; pin a version (empty tag: the chart's appVersion %s)" .image.repository .root.Chart.AppVersion) -}}
{{- end -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* kvscale.podSecurityContext, kvscale.containerSecurityContext: _security.tpl. */}}
