{{- /*
Every key this chart reads that upstream's chart lacks is read with `dig` and a default equal to
values.yaml's: `helm upgrade --reuse-values` from an upstream release renders this chart with the
old release's values only (none of values.yaml), and must neither fail nor change a default.
tests/tests/deploy_upgrade.rs proves both.
*/ -}}

{{/* Name of the chart's objects: the chart name or nameOverride (fullnameOverride renames
nothing, as upstream). */}}
{{- define "harvester-cloud-provider.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
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

{{/* "registry/" when Rancher's global.cattle.systemDefaultRegistry (or RKE2's
global.systemDefaultRegistry) is set. */}}
{{- define "system_default_registry" -}}
{{- $registry := dig "global" "cattle" "systemDefaultRegistry" "" .Values.AsMap | default (dig "global" "systemDefaultRegistry" "" .Values.AsMap) -}}
{{- with $registry -}}
{{- printf "%s/" . -}}
{{- end -}}
{{- end -}}

{{/* --cluster-name: Rancher's global.cattle.clusterName (what upstream renders), else
clusterName, else none. */}}
{{- define "harvester-cloud-provider.clusterName" -}}
{{- dig "global" "cattle" "clusterName" "" .Values.AsMap | default (dig "clusterName" "" .Values.AsMap) -}}
{{- end -}}

{{/* The cloud-config source, first match wins as upstream: "secret", "cloudConfigPath",
"hostPath"; fails naming the three keys when none is set. */}}
{{- define "harvester-cloud-provider.cloudConfigSource" -}}
{{- if dig "cloudConfig" "secretName" "" .Values.AsMap -}}
secret
{{- else if .Values.cloudConfigPath -}}
cloudConfigPath
{{- else if dig "cloudConfig" "hostPath" "" .Values.AsMap -}}
hostPath
{{- else -}}
{{- fail "the cloud-config needs a source: set cloudConfig.secretName, cloudConfigPath or cloudConfig.hostPath" -}}
{{- end -}}
{{- end -}}

{{/* kube-vip's values (the sub-chart's keys under `kube-vip`). */}}
{{- define "harvester-cloud-provider.kubeVipName" -}}
{{- dig "kube-vip" "nameOverride" "" .Values.AsMap | default "kube-vip" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "harvester-cloud-provider.kubeVipNamespace" -}}
{{- dig "kube-vip" "namespaceOverride" "" .Values.AsMap | default .Release.Namespace -}}
{{- end -}}

{{- define "harvester-cloud-provider.kubeVipSelectorLabels" -}}
app.kubernetes.io/name: {{ include "harvester-cloud-provider.kubeVipName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "harvester-cloud-provider.kubeVipLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "harvester-cloud-provider.kubeVipSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* "true" or "false" for a value kube-vip's chart reads as a boolean ("true", "1", true). */}}
{{- define "harvester-cloud-provider.toBool" -}}
{{- if has (lower (toString .)) (list "true" "1") -}}true{{- else -}}false{{- end -}}
{{- end -}}

{{/* kube-vip's placement when its values lack affinity/tolerations (the same as values.yaml):
control-plane nodes of RKE1 and RKE2, as upstream. */}}
{{- define "harvester-cloud-provider.kubeVipAffinity" -}}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
      - matchExpressions:
          - key: node-role.kubernetes.io/controlplane
            operator: Exists
      - matchExpressions:
          - key: node-role.kubernetes.io/control-plane
            operator: Exists
{{- end -}}

{{- define "harvester-cloud-provider.kubeVipTolerations" -}}
- key: node-role.kubernetes.io/control-plane
  operator: Exists
  effect: NoSchedule
- key: node-role.kubernetes.io/etcd
  operator: Exists
  effect: NoExecute
{{- end -}}
