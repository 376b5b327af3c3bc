{{- define "pagoda.fullname" -}}
{{- if contains "pagoda" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-pagoda" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.labels" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pagoda.operator.selectorLabels" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagoda.agent.selectorLabels" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: topology-agent
{{- end -}}

{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "pagoda.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) -}}
{{- end -}}

{{- define "pagoda.daemonImage" -}}
{{- printf "%s:%s" .Values.daemonImage.repository (toString (default .Chart.AppVersion .Values.daemonImage.tag)) -}}
{{- end -}}
