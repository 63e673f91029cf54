{{- define "kubesgl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubesgl.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kubesgl.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kubesgl.serviceAccountName" -}}
{{- default (include "kubesgl.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* The chart's labels and the user's `extra` ones (their values key: `field`); a key of
the chart's own is refused, as an object would carry it twice and Kubernetes keep either. */ -}}
{{- define "kubesgl.labelsWith" -}}
{{- $own := include "kubesgl.labels" .root | fromYaml -}}
{{- range $key, $_ := .extra -}}
{{- if hasKey $own $key -}}
{{- fail (printf "%s: %s is one of the chart's own labels (%s); choose another key" $.field $key (keys $own | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- include "kubesgl.labels" .root }}
{{- with .extra }}
{{ toYaml . }}
{{- end -}}
{{- end -}}
