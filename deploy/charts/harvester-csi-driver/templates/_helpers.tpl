{{- /*
Every key this chart reads that upstream's chart lacks is read with `dig` and a default equal to
values.yaml's: `helm upgrade --reuse-values` from an upstream release renders this chart with the
old release's values only (none of values.yaml), and must neither fail nor change a default.
tests/tests/deploy_upgrade.rs proves both.
*/ -}}

{{/* Name of the chart's objects: the chart name or nameOverride (fullnameOverride renames
nothing, as upstream). */}}
{{- define "harvester-csi-driver.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
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

{{/* "registry/" when Rancher's global.cattle.systemDefaultRegistry (or RKE2's
global.systemDefaultRegistry) is set, as upstream prefixes every image (harvester/charts
charts/harvester-csi-driver/templates/_helpers.tpl "system_default_registry"). A value that is no
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
{{- define "harvester-csi-driver.ownImage" -}}
{{- $repo := required (printf "%s is not set: build the image with `make images`, push it to your registry and set %s (docs/install.md, Images)" .key .key) (dig "repository" "" .image) | toString -}}
{{- if not (regexMatch `^([a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*$` $repo) -}}
{{- fail (printf "%s %q is not an image repository: [host[:port]/]path in lowercase, no scheme, no tag, no spaces (e.g. registry.example.com/team/harvester-csi-driver)" .key $repo) -}}
{{- end -}}
{{- printf "%s%s:%s" (include "system_default_registry" .ctx) $repo (toString (dig "tag" "" .image) | default .ctx.Chart.AppVersion) -}}
{{- end -}}

{{/* A pod's imagePullSecrets from lists of names or {name: ...} (a list of lists), each name
once; nothing when there is none. */}}
{{- define "harvester-csi-driver.pullSecrets" -}}
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

{{/* An image reference: (dict "ctx" $ "image" .Values.image.csi.provisioner). */}}
{{- define "harvester-csi-driver.image" -}}
{{- printf "%s%s:%s" (include "system_default_registry" .ctx) .image.repository (toString .image.tag | default .ctx.Chart.AppVersion) | quote -}}
{{- end -}}

{{/* A sidecar's image: (dict "ctx" $ "name" "provisioner"), from image.csi.<name>. The
defaults (values.yaml's) serve a release whose values lack the entry: livenessProbe is ours,
snapshotter came later to the upstream chart. */}}
{{- define "harvester-csi-driver.sidecarImage" -}}
{{- $defaults := dict
  "nodeDriverRegistrar" (dict "repository" "rancher/mirrored-longhornio-csi-node-driver-registrar" "tag" "v2.16.0-20260428")
  "provisioner" (dict "repository" "rancher/mirrored-longhornio-csi-provisioner" "tag" "v5.3.0-20260428")
  "attacher" (dict "repository" "rancher/mirrored-longhornio-csi-attacher" "tag" "v4.11.0-20260428")
  "resizer" (dict "repository" "rancher/mirrored-longhornio-csi-resizer" "tag" "v2.1.0-20260428")
  "snapshotter" (dict "repository" "rancher/mirrored-longhornio-csi-snapshotter" "tag" "v8.5.0-20260428")
  "livenessProbe" (dict "repository" "rancher/mirrored-sig-storage-livenessprobe" "tag" "v2.15.0") -}}
{{- $image := dig "image" "csi" .name (index $defaults .name) .ctx.Values.AsMap -}}
{{- include "harvester-csi-driver.image" (dict "ctx" .ctx "image" $image) -}}
{{- end -}}

{{/* A CSI sidecar's securityContext: it only talks over the driver's socket (and the
registrar over the kubelet's registration directory), both volumes, and listens on an
unprivileged port at most, so no capability, no privilege escalation, a read-only root. */}}
{{- define "harvester-csi-driver.sidecarSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* metricsPort (not in the upstream chart); 0 turns the endpoint off. */}}
{{- define "harvester-csi-driver.metricsPortNumber" -}}
{{- dig "metricsPort" 9810 .Values.AsMap -}}
{{- end -}}

{{/* nodeHealthPort (not in the upstream chart): the node livenessprobe's port, a node port on
the host network. */}}
{{- define "harvester-csi-driver.nodeHealthPort" -}}
{{- dig "nodeHealthPort" 9808 .Values.AsMap -}}
{{- end -}}

{{/* Every pod's imagePullSecrets: imagePullSecrets (ours) and global.cattle.imagePullSecrets
(upstream's key; names or {name: ...}). */}}
{{- define "harvester-csi-driver.imagePullSecrets" -}}
{{- include "harvester-csi-driver.pullSecrets" (list (dig "imagePullSecrets" list .Values.AsMap) (dig "global" "cattle" "imagePullSecrets" list .Values.AsMap)) -}}
{{- end -}}

{{/* Where the driver finds the cloud-config inside its containers. */}}
{{- define "harvester-csi-driver.cloudConfigFile" -}}
/var/lib/harvester/cloud-provider-config
{{- end -}}

{{/* The cloud-config volume, shared by the controller and node pods. */}}
{{- define "harvester-csi-driver.cloudConfigVolume" -}}
- name: cloud-config
{{- with dig "cloudConfig" "secretName" "" .Values.AsMap }}
  secret:
    secretName: {{ . }}
    items:
      - key: {{ dig "cloudConfig" "secretKey" "" $.Values.AsMap | default "cloud-provider-config" }}
        path: cloud-provider-config
{{- else }}
{{- $path := required "cloudConfig.hostPath or cloudConfig.secretName is required" (dig "cloudConfig" "hostPath" "" .Values.AsMap) | trimSuffix "/" }}
{{- if eq (base $path) "cloud-provider-config" }}
{{- $path = dir $path }}
{{- end }}
  hostPath:
    path: {{ $path }}
    type: Directory
{{- end }}
{{- end -}}

{{/* The driver's flags common to both modes: dict "ctx" (the root), "metricsHost" (the
address of /metrics, /healthz and /readyz; empty: every interface) and "kubeconfig" (the
cloud-config file; empty: none). */}}
{{- define "harvester-csi-driver.driverArgs" -}}
{{- $ctx := .ctx -}}
- --endpoint=unix:///csi/csi.sock
- --kubeconfig={{ .kubeconfig }}
{{- with $ctx.Values.hostStorageClass }}
- --host-storage-class={{ . }}
{{- end }}
{{- with include "harvester-csi-driver.metricsPortNumber" $ctx | atoi }}
- --metrics-address={{ $.metricsHost }}:{{ . }}
{{- end }}
{{- end -}}

{{/* The driver's /metrics port and its /readyz probe (when metricsPort is set). */}}
{{- define "harvester-csi-driver.metricsPort" -}}
{{- with include "harvester-csi-driver.metricsPortNumber" . | atoi }}
- name: metrics
  containerPort: {{ . }}
{{- end }}
{{- end -}}
{{/* dict "ctx" and "metricsHost" as driverArgs: a loopback metricsHost is probed there. */}}
{{- define "harvester-csi-driver.readinessProbe" -}}
{{- if include "harvester-csi-driver.metricsPortNumber" .ctx | atoi }}
readinessProbe:
  httpGet:
    {{- with .metricsHost }}
    # On the host network the kubelet probes from the node itself, so loopback reaches it.
    host: {{ . }}
    {{- end }}
    path: /readyz
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 5
{{- end }}
{{- end -}}

{{/* --cluster-name: Rancher's global.cattle.clusterName, else clusterName, else none (the
driver's default). */}}
{{- define "harvester-csi-driver.clusterName" -}}
{{- dig "global" "cattle" "clusterName" "" .Values.AsMap | default (dig "clusterName" "" .Values.AsMap) -}}
{{- end -}}
