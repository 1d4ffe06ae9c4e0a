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
global.systemDefaultRegistry) is set, as upstream prefixes every image (harvester/charts
charts/harvester-cloud-provider/templates/_helpers.tpl "system_default_registry"). A value that is no
registry (a scheme, a space) fails naming the key: the images would not pull. */}}
{{- define "system_default_registry" -}}
{{- $key := "global.cattle.systemDefaultRegistry" -}}
{{- $registry := dig "global" "cattle" "systemDefaultRegistry" "" .Values.AsMap -}}
{{- if not $registry -}}
{{- $key = "global.systemDefaultRegistry" -}}
{{- $registry = dig "global" "systemDefaultRegistry" "" .Values.AsMap -}}
{{- end -}}
{{- with $registry | toString | trimSuffix "/" -}}
{{- if not (regexMatch `^[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]+)?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*$` .) -}}
{{- fail (printf "%s %q is not a registry: host[:port] with an optional path, no scheme, no spaces (e.g. registry.example.com:5000)" $key .) -}}
{{- end -}}
{{- printf "%s/" . -}}
{{- end -}}
{{- end -}}

{{/* Our image (dict "ctx" $ "key" "image.repository" "image" <map with repository, tag>): the
repository must be set (there is no published image: docs/install.md, "Images") and be a
repository without scheme or tag; the tag defaults to the chart's appVersion. */}}
{{- define "harvester-cloud-provider.ownImage" -}}
{{- $repo := required (printf "%s is not set: build the image with `make images`, push it to your registry and set %s (docs/install.md, Images)" .key .key) (dig "repository" "" .image) | toString -}}
{{- if not (regexMatch `^([a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*$` $repo) -}}
{{- fail (printf "%s %q is not an image repository: [host[:port]/]path in lowercase, no scheme, no tag, no spaces (e.g. registry.example.com/team/harvester-cloud-provider)" .key $repo) -}}
{{- end -}}
{{- printf "%s%s:%s" (include "system_default_registry" .ctx) $repo (toString (dig "tag" "" .image) | default .ctx.Chart.AppVersion) -}}
{{- end -}}

{{/* A pod's imagePullSecrets from lists of names or {name: ...} (a list of lists), each name
once; nothing when there is none. */}}
{{- define "harvester-cloud-provider.pullSecrets" -}}
{{- $names := list -}}
{{- range $list := . -}}
{{- range $list -}}
{{- if kindIs "map" . -}}
{{- with .name -}}{{- $names = append $names (toString .) -}}{{- end -}}
{{- else if . -}}
{{- $names = append $names (toString .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $names -}}
imagePullSecrets:
{{- range . | uniq }}
  - name: {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The cloud provider's pods: imagePullSecrets (upstream's key) and Rancher's
global.cattle.imagePullSecrets. */}}
{{- define "harvester-cloud-provider.imagePullSecrets" -}}
{{- include "harvester-cloud-provider.pullSecrets" (list (dig "imagePullSecrets" list .Values.AsMap) (dig "global" "cattle" "imagePullSecrets" list .Values.AsMap)) -}}
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
