#!/usr/bin/env bash
# Manual smoke check of one KubeVirt line built by tests/scripts/kubevirt.sh: starts etcd and a
# kube-apiserver (the bed's flags, tests/src/bed/cluster.rs), applies install-manifests' output,
# creates the KubeVirt CR with the status virt-operator would write, runs the real virt-api and
# virt-controller as plain processes, then checks that a VirtualMachine create passes the real
# webhooks, that virt-controller makes the VMI and its launcher Pod, and that
# PUT .../virtualmachines/<vm>/addvolume through the aggregator answers 202; then plays the
# kubelet and virt-handler's node side by hand through a whole hot-plug and unplug (below).
# About 40 s. Not part of `make test`.
#
#   tests/kubevirt/smoke.sh 1.7.0 [FEATURE_GATE]   # FEATURE_GATE: HotplugVolumes (default) or
#                                                # DeclarativeHotplugVolumes
# Needs tests/scripts/tools.sh's etcd and kube-apiserver, kubectl, openssl, curl, python3-yaml.
# KEEP=1 leaves the processes and the directory for a look.
set -euo pipefail

V=${1:?usage: $0 VERSION [FEATURE_GATE]}; V=${V#v}
GATE=${2:-HotplugVolumes}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOLS=$("$HERE/../scripts/tools.sh" --print-dir)
KV=$("$HERE/../scripts/kubevirt.sh" --print-dir "$V")
D=$(mktemp -d /tmp/kv-smoke-v$V.XXXX)
say() { printf '[smoke v%s] %s\n' "$V" "$*"; }
PIDS=()
cleanup() {
  local rc=$?
  if [ "${KEEP:-}" = 1 ]; then say "kept $D, pids ${PIDS[*]}"; exit $rc; fi
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ $rc = 0 ] && rm -rf "$D" || say "failed; logs in $D"
  exit $rc
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# --- certificates (the bed's set, tests/src/bed/certs.rs, made with openssl) ----------------
cd "$D"
# Logs apart: virt-api and virt-controller watch their certificates' directory (fsnotify) and
# reload on every change, so a log written beside the certificates makes a reload per log line.
mkdir logs
ca() { openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -keyout "$1.key" \
  -out "$1.crt" -subj "/CN=$1" -days 2 2>/dev/null; }
leaf() { # leaf NAME CA SUBJECT EXTKEYUSAGE [SANS]
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -keyout "$1.key" -out "$1.csr" \
    -subj "$3" 2>/dev/null
  { echo "extendedKeyUsage=$4"; echo "keyUsage=digitalSignature,keyEncipherment"
    [ -n "${5:-}" ] && echo "subjectAltName=$5"; } >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -out "$1.crt" -days 2 \
    -extfile "$1.ext" 2>/dev/null
}
ca ca; ca front-proxy-ca; ca virt-ca
leaf apiserver ca /CN=kube-apiserver serverAuth "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"
leaf admin ca "/O=system:masters/CN=admin" clientAuth
leaf front-proxy-client front-proxy-ca /CN=front-proxy-client clientAuth
# virt-api's serving certificate: the aggregator and the webhooks dial virt-api.kubevirt.svc.
leaf virt-api virt-ca /CN=virt-api serverAuth "DNS:virt-api.kubevirt.svc,DNS:localhost,IP:127.0.0.1"
# virt-api's client certificate towards virt-handler, and virt-controller's metrics certificate:
# both must exist as files (bootstrap.NewFileCertificateManager) but nothing dials with them here.
leaf virt-handler-client virt-ca /CN=kubevirt.io:system:client:virt-handler clientAuth
leaf virt-controller-metrics virt-ca /CN=virt-controller serverAuth "DNS:localhost,IP:127.0.0.1"
openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null

# --- etcd + kube-apiserver ---------------------------------------------------------------------
EP=$(free_port); PP=$(free_port); AP=$(free_port); VAP=$(free_port); VCP=$(free_port)
"$TOOLS/etcd" --name=smoke --data-dir="$D/etcd" --listen-client-urls="http://127.0.0.1:$EP" \
  --advertise-client-urls="http://127.0.0.1:$EP" --listen-peer-urls="http://127.0.0.1:$PP" \
  --initial-advertise-peer-urls="http://127.0.0.1:$PP" --initial-cluster="smoke=http://127.0.0.1:$PP" \
  --unsafe-no-fsync --log-level=warn >logs/etcd.log 2>&1 & PIDS+=($!)
"$TOOLS/kube-apiserver" --etcd-servers="http://127.0.0.1:$EP" --bind-address=127.0.0.1 \
  --advertise-address=127.0.0.1 --secure-port="$AP" --tls-cert-file=apiserver.crt \
  --tls-private-key-file=apiserver.key --client-ca-file=ca.crt --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file=sa.pub \
  --service-account-signing-key-file=sa.key --service-cluster-ip-range=10.96.0.0/16 \
  --requestheader-client-ca-file=front-proxy-ca.crt --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- --proxy-client-cert-file=front-proxy-client.crt \
  --proxy-client-key-file=front-proxy-client.key --cert-dir="$D/apiserver-certs" \
  --enable-priority-and-fairness=false --profiling=false --allow-privileged=true --v=1 \
  >logs/apiserver.log 2>&1 & PIDS+=($!)

kubeconfig() { # kubeconfig FILE USER (client cert USER.crt or token file USER.token)
  local auth
  if [ -f "$D/$2.token" ]; then auth="    token: $(cat "$D/$2.token")"
  else auth="    client-certificate: $D/$2.crt
    client-key: $D/$2.key"; fi
  cat >"$1" <<KC
apiVersion: v1
kind: Config
clusters: [{name: smoke, cluster: {server: "https://127.0.0.1:$AP", certificate-authority: "$D/ca.crt"}}]
users:
- name: $2
  user:
$auth
contexts: [{name: smoke, context: {cluster: smoke, user: $2}}]
current-context: smoke
KC
}
kubeconfig admin.kubeconfig admin
export KUBECONFIG=$D/admin.kubeconfig
k() { kubectl "$@"; }
t0=$(date +%s)
until k get --raw /readyz >/dev/null 2>&1; do
  sleep 0.5; [ $(( $(date +%s) - t0 )) -lt 60 ] || { say "apiserver not ready"; tail logs/apiserver.log; exit 1; }
done
say "kube-apiserver ready on $AP in $(( $(date +%s) - t0 ))s"

# --- what virt-operator would install -----------------------------------------------------------
k create namespace kubevirt >/dev/null
"$KV/install-manifests" --namespace kubevirt >manifests.yaml 2>install-manifests.log
# The operator injects virt-api's CA into its webhooks and APIServices; here the Service virt-api
# is an ExternalName to localhost (as the bed's register_virt_api does), so every reference to it
# also takes virt-api's real port. The operator's own webhook (virt-operator-validator) is dropped:
# no virt-operator runs.
cat >bed.py <<'PY'
import base64, sys, yaml
port, ca = int(sys.argv[1]), base64.b64encode(open(sys.argv[2], 'rb').read()).decode()
out = []
for d in yaml.safe_load_all(sys.stdin):
    if not d:
        continue
    kind, name = d['kind'], d['metadata']['name']
    if kind == 'ValidatingWebhookConfiguration' and name == 'virt-operator-validator':
        continue
    if kind in ('ValidatingWebhookConfiguration', 'MutatingWebhookConfiguration'):
        for w in d['webhooks']:
            w['clientConfig']['caBundle'] = ca
            w['clientConfig']['service']['port'] = port
    if kind == 'APIService':
        d['spec']['caBundle'] = ca
        d['spec']['service']['port'] = port
    out.append(d)
kinds = {}
for d in out:
    kinds[d['kind']] = kinds.get(d['kind'], 0) + 1
sys.stderr.write('applying %s\n' % ', '.join('%d %s' % (n, k) for k, n in sorted(kinds.items())))
yaml.safe_dump_all(out, sys.stdout)
PY
python3 bed.py "$VAP" "$D/virt-ca.crt" <manifests.yaml >manifests-bed.yaml
# CRDs first (so the webhooks never see a request for a type not yet served), then the rest.
python3 -c 'import sys,yaml; ds=[d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"]==sys.argv[2]]; yaml.safe_dump_all(ds, sys.stdout)' \
  manifests-bed.yaml CustomResourceDefinition >crds.yaml
k apply --server-side -f crds.yaml >/dev/null
k wait --for=condition=Established --timeout=60s crd --all >/dev/null
k apply --server-side -f manifests-bed.yaml >/dev/null
say "applied $(grep -c '^kind:' manifests-bed.yaml) objects ($(grep -c '^kind: CustomResourceDefinition' manifests-bed.yaml) CRDs)"
cat <<SVC | k apply -f - >/dev/null
apiVersion: v1
kind: Service
metadata: {name: virt-api, namespace: kubevirt}
spec: {type: ExternalName, externalName: localhost, ports: [{name: https, port: $VAP, protocol: TCP}]}
SVC
# virt-api's CA for virt-handler clients (--ca-configmap-name, default kubevirt-ca).
k -n kubevirt create configmap kubevirt-ca --from-file=ca-bundle=virt-ca.crt >/dev/null

# --- the KubeVirt CR, with the status virt-operator would write -------------------------------
cat <<CR | k apply -f - >/dev/null
apiVersion: kubevirt.io/v1
kind: KubeVirt
metadata: {name: kubevirt, namespace: kubevirt}
spec:
  configuration:
    developerConfiguration: {featureGates: [$GATE]}
CR
k -n kubevirt patch kubevirt kubevirt --subresource=status --type=merge -p "{\"status\":{\"phase\":\"Deployed\",\"defaultArchitecture\":\"amd64\",\"observedKubeVirtVersion\":\"v$V\",\"targetKubeVirtVersion\":\"v$V\"}}" >/dev/null

# --- identities: ServiceAccount tokens (the SAs come from the manifests) ------------------------
for sa in kubevirt-apiserver kubevirt-controller; do
  k -n kubevirt create token "$sa" --duration=24h >"$sa.token"
  kubeconfig "$sa.kubeconfig" "$sa"
done

# --- virt-api, virt-controller --------------------------------------------------------------------
"$KV/virt-api" --kubeconfig="$D/kubevirt-apiserver.kubeconfig" --listen=127.0.0.1 --port="$VAP" \
  --tls-cert-file="$D/virt-api.crt" --tls-key-file="$D/virt-api.key" \
  --handler-cert-file="$D/virt-handler-client.crt" --handler-key-file="$D/virt-handler-client.key" \
  >logs/virt-api.log 2>&1 & PIDS+=($!)
"$KV/virt-controller" --kubeconfig="$D/kubevirt-controller.kubeconfig" --listen=127.0.0.1 --port="$VCP" \
  --launcher-image="quay.io/kubevirt/virt-launcher:v$V" --exporter-image="quay.io/kubevirt/virt-exportserver:v$V" \
  --prom-cert-file="$D/virt-controller-metrics.crt" --prom-key-file="$D/virt-controller-metrics.key" \
  >logs/virt-controller.log 2>&1 & PIDS+=($!)

wait_for() { # wait_for SECONDS WHAT COMMAND...
  local s=$1 what=$2 t; shift 2; t=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    sleep 1
    if [ $(( $(date +%s) - t )) -ge "$s" ]; then say "timeout: $what"; return 1; fi
  done
  say "$what after $(( $(date +%s) - t ))s"
}
apiservice_available() { [ "$(k get apiservice v1.subresources.kubevirt.io -o jsonpath='{.status.conditions[?(@.type=="Available")].status}')" = True ]; }
wait_for 90 "APIService v1.subresources.kubevirt.io Available" apiservice_available
wait_for 90 "virt-controller leader (lease virt-controller)" k -n kubevirt get lease virt-controller

# --- a VM namespace, a VM, the VMI and its launcher Pod ----------------------------------------------
k create namespace vms >/dev/null
k -n vms create serviceaccount default >/dev/null
cat <<PVC | k apply -f - >/dev/null
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: hp1, namespace: vms}
spec: {accessModes: [ReadWriteOnce], volumeMode: Block, resources: {requests: {storage: 1Gi}}}
PVC
cat <<VM | k apply -f - 2>&1 | tee vm-create.out
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: vm1, namespace: vms}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        devices: {disks: [{name: root, disk: {bus: virtio}}]}
        resources: {requests: {memory: 64Mi}}
      volumes: [{name: root, containerDisk: {image: quay.io/kubevirt/cirros-container-disk-demo:v$V}}]
VM
# The mutating webhook fills in defaults: proof that it ran.
k -n vms get vm vm1 -o jsonpath='{.spec.template.spec.domain.machine.type}{" "}{.spec.template.spec.architecture}{"\n"}' | sed 's/^/[smoke] VM defaults by the mutating webhook (machine type, architecture): /'
# A refused VM proves the validating webhook: a disk that names no volume.
if k -n vms create -f - >refused.out 2>&1 <<BAD
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: bad, namespace: vms}
spec:
  runStrategy: Halted
  template:
    spec:
      domain: {devices: {disks: [{name: nothere, disk: {bus: virtio}}]}}
BAD
then say "FAIL: the validating webhook let an invalid VM through"; exit 1; fi
say "invalid VM refused: $(head -c 300 refused.out)"
wait_for 60 "VMI vm1 created by virt-controller" k -n vms get vmi vm1
launcher_pod() { [ -n "$(k -n vms get pods -l kubevirt.io=virt-launcher -o name)" ]; }
wait_for 60 "launcher Pod created by virt-controller" launcher_pod
k -n vms get pods -o wide
k -n vms get vmi vm1 -o jsonpath='{.status.phase}{"\n"}' | sed 's/^/[smoke] VMI phase: /'

# --- addvolume through the aggregator ----------------------------------------------------------------------
code=$(curl -sS -o addvolume.out -w '%{http_code}' --cacert ca.crt --cert admin.crt --key admin.key \
  -X PUT -H 'Content-Type: application/json' \
  "https://127.0.0.1:$AP/apis/subresources.kubevirt.io/v1/namespaces/vms/virtualmachines/vm1/addvolume" \
  -d '{"name":"hp1","disk":{"disk":{"bus":"scsi"}},"volumeSource":{"persistentVolumeClaim":{"claimName":"hp1"}}}')
say "addvolume: HTTP $code $(head -c 300 addvolume.out)"
[ "$code" = 202 ] || exit 1
if [ "$GATE" = HotplugVolumes ]; then
  k -n vms get vm vm1 -o jsonpath='{.status.volumeRequests}{"\n"}' | sed 's/^/[smoke] vm.status.volumeRequests: /'
else
  k -n vms get vm vm1 -o jsonpath='{.spec.template.spec.volumes[*].name}{"\n"}' | sed 's/^/[smoke] vm template volumes: /'
fi
say "addvolume OK"

# --- further: play kubelet and virt-handler through the hot-plug and the unplug -----------------------
# (STOP_AT_ADDVOLUME=1 skips this.) The kubelet play binds the launcher Pod to a Node and writes it
# Running and Ready; virt-controller then marks the VMI Scheduled on that node; the virt-handler
# play writes the VMI Running with selinuxContext none, as kubevirt-handler (on an update by anyone
# but KubeVirt's own service accounts virt-api's VMI mutating webhook puts the old status back);
# virt-controller then moves the volume request into the VMI and, the PVC Bound, creates the
# attachment Pod (hp-volume-*); that Pod run by the kubelet play, virt-controller writes the
# volume AttachedToNode, and the virt-handler play writes it Ready; removevolume takes it out of
# the VMI, the virt-handler play writes it UnMountedFromPod, and virt-controller deletes the
# attachment Pod and the volume's status.
[ "${STOP_AT_ADDVOLUME:-}" = 1 ] && exit 0
k -n kubevirt create token kubevirt-handler --duration=24h >kubevirt-handler.token
kubeconfig kubevirt-handler.kubeconfig kubevirt-handler
cat <<NODE | k apply -f - >/dev/null
apiVersion: v1
kind: Node
metadata: {name: node1, labels: {kubevirt.io/schedulable: "true", kubernetes.io/hostname: node1}}
NODE
# run_pod POD IP: the kubelet play: bind POD to node1, write it Running and Ready.
run_pod() {
  local now statuses
  k -n vms create -f - >/dev/null <<BIND
apiVersion: v1
kind: Binding
metadata: {name: $1, namespace: vms}
target: {apiVersion: v1, kind: Node, name: node1}
BIND
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  statuses=$(k -n vms get pod "$1" -o json | python3 -c '
import json, sys
p = json.load(sys.stdin)
now, ip = sys.argv[1], sys.argv[2]
cs = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0,
       "started": True, "state": {"running": {"startedAt": now}}} for c in p["spec"]["containers"]]
conds = [{"type": t, "status": "True", "lastTransitionTime": now} for t in
         ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
conds += [{"type": g["conditionType"], "status": "True", "lastTransitionTime": now}
          for g in p["spec"].get("readinessGates", [])]
print(json.dumps({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
      "hostIP": "127.0.0.1", "startTime": now, "conditions": conds, "containerStatuses": cs}}))' "$now" "$2")
  k -n vms patch pod "$1" --subresource=status --type=merge -p "$statuses" >/dev/null
}
run_pod "$(k -n vms get pods -l kubevirt.io=virt-launcher -o jsonpath='{.items[0].metadata.name}')" 10.0.0.10
vmi_phase() { [ "$(k -n vms get vmi vm1 -o jsonpath='{.status.phase}')" = "$1" ]; }
wait_for 60 "VMI Scheduled (virt-controller saw the launcher Pod ready)" vmi_phase Scheduled
# The VMI CRD has no status subresource, and kubevirt-handler's ClusterRole grants VMIs only
# update, list and watch (no get, no patch): the play reads as admin and PUTs as the handler.
k -n vms get vmi vm1 -o json | python3 -c '
import json, sys
v = json.load(sys.stdin)
v["status"].update({"phase": "Running", "selinuxContext": "none"})
print(json.dumps(v))' | KUBECONFIG=$D/kubevirt-handler.kubeconfig kubectl replace -f - >/dev/null
wait_for 30 "VMI Running (written as kubevirt-handler)" vmi_phase Running
k -n vms patch pvc hp1 --subresource=status --type=merge \
  -p '{"status":{"phase":"Bound","accessModes":["ReadWriteOnce"],"capacity":{"storage":"1Gi"}}}' >/dev/null
in_vmi() { k -n vms get vmi vm1 -o jsonpath='{.spec.volumes[*].name}' | grep -qw hp1; }
wait_for 60 "volume hp1 in the VMI spec (virt-controller applied the request)" in_vmi
attachment_pod() { [ -n "$(k -n vms get pods -l kubevirt.io=hotplug-disk -o name)" ]; }
wait_for 60 "attachment Pod created by virt-controller" attachment_pod
# The attachment Pod running: virt-controller writes the volume AttachedToNode
# (pkg/virt-controller/watch/vmi/storage.go); MountedToPod and Ready are virt-handler's.
run_pod "$(k -n vms get pods -l kubevirt.io=hotplug-disk -o jsonpath='{.items[0].metadata.name}')" 10.0.0.11
volume_phase() { [ "$(k -n vms get vmi vm1 -o jsonpath='{.status.volumeStatus[?(@.name=="hp1")].phase}')" = "$1" ]; }
wait_for 60 "volume hp1 AttachedToNode (virt-controller saw the attachment Pod ready)" volume_phase AttachedToNode
k -n vms get vmi vm1 -o json | python3 -c '
import json, sys
v = json.load(sys.stdin)
for vs in v["status"]["volumeStatus"]:
    if vs["name"] == "hp1":
        vs.update({"phase": "Ready", "reason": "VolumeReady", "target": "sda",
                   "message": "Successfully attach hotplugged volume hp1 to VM"})
print(json.dumps(v))' | KUBECONFIG=$D/kubevirt-handler.kubeconfig kubectl replace -f - >/dev/null
wait_for 30 "volume hp1 Ready (written as kubevirt-handler)" volume_phase Ready
sleep 3; volume_phase Ready || { say "FAIL: the volume's Ready was not kept"; exit 1; }
k -n vms get pods -o wide

# --- removevolume: out of the VMI spec, then (the volume unmounted) the attachment Pod deleted ----
code=$(curl -sS -o removevolume.out -w '%{http_code}' --cacert ca.crt --cert admin.crt --key admin.key \
  -X PUT -H 'Content-Type: application/json' \
  "https://127.0.0.1:$AP/apis/subresources.kubevirt.io/v1/namespaces/vms/virtualmachines/vm1/removevolume" \
  -d '{"name":"hp1"}')
say "removevolume: HTTP $code $(head -c 300 removevolume.out)"
[ "$code" = 202 ] || exit 1
not_in_vmi() { ! in_vmi; }
wait_for 60 "volume hp1 out of the VMI spec" not_in_vmi
# virt-controller keeps the attachment Pod while the volume is Ready or MountedToPod
# (volume-hotplug.go volumeReadyForPodDelete): the virt-handler play writes it UnMountedFromPod,
# as virt-handler does once it has unmounted it (pkg/virt-handler/vm.go).
k -n vms get vmi vm1 -o json | python3 -c '
import json, sys
v = json.load(sys.stdin)
for vs in v["status"]["volumeStatus"]:
    if vs["name"] == "hp1":
        vs.update({"phase": "UnMountedFromPod", "reason": "VolumeUnMountedFromPod",
                   "message": "Volume hp1 has been unmounted from virt-launcher pod"})
print(json.dumps(v))' | KUBECONFIG=$D/kubevirt-handler.kubeconfig kubectl replace -f - >/dev/null
no_attachment_pod() { [ -z "$(k -n vms get pods -l kubevirt.io=hotplug-disk -o name)" ]; }
wait_for 60 "attachment Pod deleted by virt-controller" no_attachment_pod
no_status() { ! k -n vms get vmi vm1 -o jsonpath='{.status.volumeStatus[*].name}' | grep -qw hp1; }
wait_for 60 "volume hp1 out of the VMI status (virt-controller)" no_status
k -n vms get vmi vm1 -o jsonpath='{.status.volumeStatus[*].name}{" "}{.status.volumeStatus[*].phase}{"\n"}' | sed 's/^/[smoke] VMI volumeStatus after unplug: /'
k -n vms get pods -o wide
say "OK"
