{{/* Name of the chart's objects (upstream names them after the chart, not the release). */}}
{{- define "harvester-cloud-provider.name" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "harvester-cloud-provider.selectorLabels" -}}
app.kubernetes.io/name: {{ include "harvester-cloud-provider.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "harvester-cloud-provider.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "harvester-cloud-provider.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "harvester-cloud-provider.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "harvester-cloud-provider.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "registry/" when Rancher's global.cattle.systemDefaultRegistry is set. */}}
{{- define "system_default_registry" -}}
{{- with .Values.global.cattle.systemDefaultRegistry -}}
{{- printf "%s/" . -}}
{{- end -}}
{{- end -}}

{{/* --cluster-name: clusterName, else Rancher's global.cattle.clusterName, else none. */}}
{{- define "harvester-cloud-provider.clusterName" -}}
{{- default .Values.global.cattle.clusterName .Values.clusterName -}}
{{- end -}}
