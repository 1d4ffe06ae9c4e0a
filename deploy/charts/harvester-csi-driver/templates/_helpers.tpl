{{/* Name of the chart's objects (upstream names them after the chart, not the release). */}}
{{- define "harvester-csi-driver.name" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "harvester-csi-driver.selectorLabels" -}}
app.kubernetes.io/name: {{ include "harvester-csi-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "harvester-csi-driver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "harvester-csi-driver.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* "registry/" when Rancher's global.cattle.systemDefaultRegistry is set. */}}
{{- define "system_default_registry" -}}
{{- with .Values.global.cattle.systemDefaultRegistry -}}
{{- printf "%s/" . -}}
{{- end -}}
{{- end -}}

{{/* An image reference: (dict "ctx" $ "image" .Values.image.csi.provisioner). */}}
{{- define "harvester-csi-driver.image" -}}
{{- printf "%s%s:%s" (include "system_default_registry" .ctx) .image.repository (.image.tag | default .ctx.Chart.AppVersion) | quote -}}
{{- end -}}

{{/* imagePullSecrets from global.cattle.imagePullSecrets (names or {name: ...}). */}}
{{- define "harvester-csi-driver.imagePullSecrets" -}}
{{- $names := list -}}
{{- range .Values.global.cattle.imagePullSecrets -}}
{{- if kindIs "map" . -}}
{{- with .name -}}{{- $names = append $names . -}}{{- end -}}
{{- else if . -}}
{{- $names = append $names . -}}
{{- end -}}
{{- end -}}
{{- with $names -}}
imagePullSecrets:
{{- range . | uniq }}
  - name: {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Where the driver finds the cloud-config inside its containers. */}}
{{- define "harvester-csi-driver.cloudConfigFile" -}}
/var/lib/harvester/cloud-provider-config
{{- end -}}

{{/* The cloud-config volume, shared by the controller and node pods. */}}
{{- define "harvester-csi-driver.cloudConfigVolume" -}}
- name: cloud-config
{{- if .Values.cloudConfig.secretName }}
  secret:
    secretName: {{ .Values.cloudConfig.secretName }}
    items:
      - key: {{ .Values.cloudConfig.secretKey | default "cloud-provider-config" }}
        path: cloud-provider-config
{{- else }}
{{- $path := required "cloudConfig.hostPath or cloudConfig.secretName is required" .Values.cloudConfig.hostPath | trimSuffix "/" }}
{{- if eq (base $path) "cloud-provider-config" }}
{{- $path = dir $path }}
{{- end }}
  hostPath:
    path: {{ $path }}
    type: Directory
{{- end }}
{{- end -}}

{{/* The driver's flags common to both modes. */}}
{{- define "harvester-csi-driver.driverArgs" -}}
- --endpoint=unix:///csi/csi.sock
- --kubeconfig={{ include "harvester-csi-driver.cloudConfigFile" . }}
{{- with .Values.hostStorageClass }}
- --host-storage-class={{ . }}
{{- end }}
{{- with .Values.metricsPort }}
- --metrics-address=:{{ . }}
{{- end }}
{{- end -}}

{{/* The driver's /metrics port and its /readyz probe (when metricsPort is set). */}}
{{- define "harvester-csi-driver.metricsPort" -}}
{{- with .Values.metricsPort }}
- name: metrics
  containerPort: {{ . }}
{{- end }}
{{- end -}}
{{- define "harvester-csi-driver.readinessProbe" -}}
{{- if .Values.metricsPort }}
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 5
{{- end }}
{{- end -}}
