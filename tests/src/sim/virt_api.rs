//! virt-api's hot-plug subresources, served over HTTPS behind the real API aggregation layer.
//!
//! The aggregator authenticates and authorises the caller (RBAC on `virtualmachines/addvolume`),
//! then proxies here with the front-proxy client certificate, which this server requires. The
//! handlers answer as virt-api does (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-api/rest/volumes.go`):
//! under `HotplugVolumes` a request in the VM's `status.volumeRequests`, under the declarative
//! gate alone a VM spec patch; volume conflicts 409 with upstream's texts; a lost race the API
//! server's 422. [`run_controller`] plays virt-controller and virt-handler: the VM spec, the VMI
//! spec and, after `hotplug_delay`, the VMI's `volumeStatus` phases up to `Ready` plus the disk
//! link in the guest node's by-id directory.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use harvester_common::harvester::hotplug;
use harvester_common::harvester::kubevirt::{
    Disk, PvcVolumeSource, VOLUME_READY, Volume, VolumeStatus,
};
use harvester_common::harvester::{
    AddVolumeOptions, RemoveVolumeOptions, Rest, VirtualMachine, VirtualMachineInstance,
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::api::{Api, PostParams};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::storage::Storage;
use crate::BedError;
use crate::bed::certs::Pki;
use crate::real::vm::{Vm, device_id};

pub const GROUP_VERSION: &str = "subresources.kubevirt.io/v1";
/// Prefix of the by-id name QEMU gives a SCSI disk with a serial.
pub const BY_ID_PREFIX: &str = "scsi-0QEMU_QEMU_HARDDISK_";

pub struct VirtApi {
    pub port: u16,
    tasks: JoinSet<()>,
}

pub struct HotplugCtx {
    pub client: kube::Client,
    pub storage: Arc<Storage>,
    pub by_id_root: PathBuf,
    pub delay: Duration,
    /// Every well-formed hot-plug request that reached the stand-in, accepted or refused, in order.
    pub calls: Mutex<Vec<HotplugCall>>,
    /// Guest nodes backed by a real VM (QEMU): their disks are hot-plugged over QMP.
    pub vms: Mutex<HashMap<String, Arc<Vm>>>,
    /// Guest nodes whose by-id links go elsewhere than `by_id_root/<node>`: a real node of the
    /// bed reads the host's `/dev/disk/by-id`, where its node plugin Pod looks.
    pub by_id_dirs: Mutex<HashMap<String, PathBuf>>,
    /// KubeVirt's hot-plug feature gates, as the Harvester release under test enables them.
    pub gates: Mutex<Gates>,
    /// What the qemu-guest-agent of a sim-only VMI (`namespace/name`) reports as its host name.
    pub agent_hostnames: Mutex<HashMap<String, String>>,
}

/// KubeVirt's two hot-plug feature gates. Harvester's chart enables `HotplugVolumes` in v1.7
/// (KubeVirt v1.6.0) and only `DeclarativeHotplugVolumes` from v1.8 (KubeVirt v1.7.0, v1.8.3 on
/// master): harvester/harvester `deploy/charts/harvester/values.yaml`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gates {
    pub hotplug_volumes: bool,
    pub declarative: bool,
}

impl Gates {
    /// Harvester v1.7.
    pub const HOTPLUG_VOLUMES: Gates = Gates {
        hotplug_volumes: true,
        declarative: false,
    };
    /// Harvester v1.8 and v1.9.
    pub const DECLARATIVE: Gates = Gates {
        hotplug_volumes: false,
        declarative: true,
    };
    /// Harvester v1.8+ with `HotplugVolumes` enabled again by an administrator.
    pub const BOTH: Gates = Gates {
        hotplug_volumes: true,
        declarative: true,
    };

    /// The gates Harvester's chart enables in the release `mode` stands for.
    pub fn of(mode: harvester_common::harvester::HotplugMode) -> Gates {
        match mode {
            harvester_common::harvester::HotplugMode::Subresource => Gates::HOTPLUG_VOLUMES,
            harvester_common::harvester::HotplugMode::Declarative => Gates::DECLARATIVE,
        }
    }

    /// Whether virt-controller hot-plugs from VM spec edits: only under the declarative gate
    /// alone (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-controller/watch/vm/vm.go`
    /// `handleDeclarativeVolumeHotplug`).
    pub fn declarative_controller(self) -> bool {
        self.declarative && !self.hotplug_volumes
    }
}

/// [`HotplugCall::verb`] of KubeVirt taking a volume into a VMI (whichever gate brought it).
pub const VMI_ADD: &str = "vmi-add";
/// [`HotplugCall::verb`] of KubeVirt taking a volume out of a VMI.
pub const VMI_REMOVE: &str = "vmi-remove";

/// [`HotplugCall::verb`] of a `guestosinfo` GET (volume empty).
pub const GUEST_OS_INFO: &str = "guestosinfo";
/// virt-api's `vmiNotRunning` (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-api/rest/subresource.go`).
pub const VMI_NOT_RUNNING: &str = "VMI is not running";
/// virt-api's `vmiGuestAgentErr` (same file and versions).
pub const VMI_NO_AGENT: &str = "VMI does not have guest agent connected";

/// How long a VM-backed hot-plug waits for the guest kernel to show the disk.
const GUEST_DISK_WAIT: Duration = Duration::from_secs(60);

/// One `addvolume` / `removevolume` request as virt-api received it, or one change of a VMI's
/// volumes that KubeVirt made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotplugCall {
    /// `addvolume`, `removevolume`, [`VMI_ADD`] or [`VMI_REMOVE`].
    pub verb: String,
    pub namespace: String,
    pub vm: String,
    /// The volume name in the request (`AddVolumeOptions.name` / `RemoveVolumeOptions.name`).
    pub volume: String,
}

/// What virt-api answers (400 BadRequest) to `addvolume`/`removevolume` when neither hot-plug gate
/// is on: kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-api/rest/volumes.go`
/// `hotplugVolumeNotEnabledError`.
pub const GATE_REFUSAL: &str =
    "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.";

impl HotplugCtx {
    /// The feature gates in force.
    pub fn gates(&self) -> Gates {
        *self.gates.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches the feature gates (a Harvester upgrade, or an administrator's edit).
    pub fn set_gates(&self, gates: Gates) {
        *self.gates.lock().unwrap_or_else(|e| e.into_inner()) = gates;
    }

    /// Backs guest node `node` with the real VM `vm`.
    pub fn back_with_vm(&self, node: &str, vm: Arc<Vm>) {
        self.vms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node.to_string(), vm);
    }

    /// The real VM behind guest node `node`, if it has one.
    pub fn vm(&self, node: &str) -> Option<Arc<Vm>> {
        self.vms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .cloned()
    }

    /// Makes the sim-only guest of VMI `namespace/name` report `hostname` through its agent.
    pub fn set_agent_hostname(&self, namespace: &str, name: &str, hostname: &str) {
        self.agent_hostnames
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(format!("{namespace}/{name}"), hostname.to_string());
    }

    fn agent_hostname(&self, namespace: &str, name: &str) -> Option<String> {
        self.agent_hostnames
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&format!("{namespace}/{name}"))
            .cloned()
    }

    /// The by-id directory the guest node `node` sees.
    pub fn by_id_dir(&self, node: &str) -> PathBuf {
        self.by_id_dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .cloned()
            .unwrap_or_else(|| self.by_id_root.join(node))
    }

    /// Links the disks hot-plugged into guest node `node` in `dir` from now on.
    pub fn set_by_id_dir(&self, node: &str, dir: PathBuf) {
        self.by_id_dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node.to_string(), dir);
    }

    /// How many times KubeVirt took volume `volume` into the VMI of VM `vm`, whichever gate and
    /// request brought it there.
    pub fn plugs(&self, vm: &str, volume: &str) -> usize {
        self.count(VMI_ADD, vm, volume)
    }

    /// How many times KubeVirt took volume `volume` out of the VMI of VM `vm`.
    pub fn unplugs(&self, vm: &str, volume: &str) -> usize {
        self.count(VMI_REMOVE, vm, volume)
    }

    /// How many `verb` events for volume `volume` of VM `vm` the stand-in has seen.
    pub fn count(&self, verb: &str, vm: &str, volume: &str) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|c| c.verb == verb && c.vm == vm && c.volume == volume)
            .count()
    }

    pub(super) fn record(&self, verb: &str, namespace: &str, vm: &str, volume: &str) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(HotplugCall {
                verb: verb.to_string(),
                namespace: namespace.to_string(),
                vm: vm.to_string(),
                volume: volume.to_string(),
            });
    }
}

fn tls_config(pki: &Pki) -> Result<rustls::ServerConfig, BedError> {
    let e = |what: &str, e: &dyn std::fmt::Display| {
        BedError::Setup(format!("virt-api TLS {what}: {e}"))
    };
    let certs: Vec<CertificateDer<'static>> =
        rustls_pemfile::certs(&mut pki.virt_api.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|x| e("cert", &x))?;
    let key: PrivateKeyDer<'static> =
        rustls_pemfile::private_key(&mut pki.virt_api.key_pem.as_bytes())
            .map_err(|x| e("key", &x))?
            .ok_or_else(|| BedError::Setup("virt-api TLS key: none in PEM".into()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pki.front_proxy_ca.cert_pem.as_bytes()) {
        roots
            .add(c.map_err(|x| e("front-proxy CA", &x))?)
            .map_err(|x| e("front-proxy CA", &x))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|x| e("client verifier", &x))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|x| e("versions", &x))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|x| e("cert", &x))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

impl VirtApi {
    /// Listens on 127.0.0.1 and, when the machine has it, ::1 (the aggregator dials `localhost`).
    pub async fn start(pki: &Pki, ctx: Arc<HotplugCtx>) -> Result<VirtApi, BedError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(pki)?));
        let v4 = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| BedError::Setup(format!("virt-api: binding 127.0.0.1: {e}")))?;
        let port = v4
            .local_addr()
            .map_err(|e| BedError::Setup(format!("virt-api: {e}")))?
            .port();
        let mut tasks = JoinSet::new();
        tasks.spawn(serve(v4, acceptor.clone(), ctx.clone()));
        if let Ok(v6) = TcpListener::bind(("::1", port)).await {
            tasks.spawn(serve(v6, acceptor, ctx));
        }
        Ok(VirtApi { port, tasks })
    }
}

impl Drop for VirtApi {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

async fn serve(listener: TcpListener, acceptor: tokio_rustls::TlsAcceptor, ctx: Arc<HotplugCtx>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let acceptor = acceptor.clone();
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(tls) => tls,
                Err(e) => {
                    tracing::debug!("virt-api: TLS handshake: {e}");
                    return;
                }
            };
            // Each request runs to completion in its own task, as virt-api's handlers do: a
            // caller that goes away mid-request (a killed CSI driver) does not cut it short.
            let svc = hyper::service::service_fn(move |req| {
                let ctx = ctx.clone();
                async move {
                    let reply = tokio::spawn(route(req, ctx)).await.unwrap_or_else(|e| {
                        failure(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "InternalError",
                            format!("virt-api stand-in handler: {e}"),
                        )
                    });
                    Ok::<_, Infallible>(reply)
                }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await;
        });
    }
}

type Reply = Response<Full<Bytes>>;

fn reply(code: StatusCode, body: serde_json::Value) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// A `metav1.Status` failure, as the API server would relay it to the caller.
fn failure(code: StatusCode, reason: &str, message: String) -> Reply {
    reply(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

async fn route(req: Request<Incoming>, ctx: Arc<HotplugCtx>) -> Reply {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    if method == Method::GET && path == format!("/apis/{GROUP_VERSION}") {
        return reply(StatusCode::OK, resource_list());
    }
    let parts: Vec<&str> = path.split('/').collect();
    if let [
        "",
        "apis",
        "subresources.kubevirt.io",
        "v1",
        "namespaces",
        ns,
        "virtualmachineinstances",
        vmi,
        "guestosinfo",
    ] = parts.as_slice()
        && method == Method::GET
    {
        ctx.record(GUEST_OS_INFO, ns, vmi, "");
        return guest_os_info(&ctx, ns, vmi).await;
    }
    // ["", "apis", "subresources.kubevirt.io", "v1", "namespaces", ns, "virtualmachines", vm, verb]
    if let [
        "",
        "apis",
        "subresources.kubevirt.io",
        "v1",
        "namespaces",
        ns,
        "virtualmachines",
        vm,
        verb,
    ] = parts.as_slice()
        && method == Method::PUT
    {
        let (ns, vm, verb) = (ns.to_string(), vm.to_string(), verb.to_string());
        let body = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return failure(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
        };
        let gates = ctx.gates();
        if !gates.hotplug_volumes
            && !gates.declarative
            && matches!(verb.as_str(), "addvolume" | "removevolume")
        {
            let name = match verb.as_str() {
                "addvolume" => serde_json::from_slice::<AddVolumeOptions>(&body).map(|o| o.name),
                _ => serde_json::from_slice::<RemoveVolumeOptions>(&body).map(|o| o.name),
            };
            ctx.record(&verb, &ns, &vm, &name.unwrap_or_default());
            return failure(StatusCode::BAD_REQUEST, "BadRequest", GATE_REFUSAL.into());
        }
        return match verb.as_str() {
            "addvolume" => match serde_json::from_slice::<AddVolumeOptions>(&body) {
                Ok(opts) => {
                    ctx.record(&verb, &ns, &vm, &opts.name);
                    add_volume(&ctx, &ns, &vm, opts, gates).await
                }
                Err(e) => failure(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    format!("bad AddVolumeOptions: {e}"),
                ),
            },
            "removevolume" => match serde_json::from_slice::<RemoveVolumeOptions>(&body) {
                Ok(opts) => {
                    ctx.record(&verb, &ns, &vm, &opts.name);
                    remove_volume(&ctx, &ns, &vm, opts, gates).await
                }
                Err(e) => failure(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    format!("bad RemoveVolumeOptions: {e}"),
                ),
            },
            _ => failure(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("no subresource {verb}"),
            ),
        };
    }
    failure(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{method} {path} is not served"),
    )
}

fn resource_list() -> serde_json::Value {
    let r = |name: &str| json!({"name": name, "namespaced": true, "kind": "", "verbs": ["update"]});
    json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION,
        "resources": [
            r("virtualmachines/addvolume"), r("virtualmachines/removevolume"),
            r("virtualmachineinstances/addvolume"), r("virtualmachineinstances/removevolume"),
            json!({"name": "virtualmachineinstances/guestosinfo", "namespaced": true,
                   "kind": "VirtualMachineInstanceGuestAgentInfo", "verbs": ["get"]}),
        ]
    })
}

/// An error as virt-api's GET subresource handlers write it (kubevirt/kubevirt v1.6.0, v1.7.0,
/// v1.8.3 `pkg/virt-api/rest/subresource.go` `httpGetRequestHandler`): whatever the
/// `StatusError` (a 409 Conflict, a 404), `response.WriteError(http.StatusInternalServerError,
/// err)`, which go-restful v3 writes as status 500 with the error's text as a plain body.
fn get_handler_error(message: String) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(message)));
    *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// virt-api's VMI `guestosinfo` (kubevirt/kubevirt v1.6.0, v1.7.0, v1.8.3
/// `pkg/virt-api/rest/subresource.go` `GuestOSInfo`): the VMI must be `Running` and have the
/// `AgentConnected` condition, else the conflict `VMI is not running` / `VMI does not have guest
/// agent connected` (written by [`get_handler_error`]); then virt-handler asks virt-launcher,
/// whose agent poller has the guest's `guest-get-host-name` and `guest-get-osinfo`. The answer is
/// a `VirtualMachineInstanceGuestAgentInfo` (`staging/src/kubevirt.io/api/core/v1/types.go`). A
/// guest backed by a real VM is asked over its agent channel; a sim-only guest answers what the
/// test gave it ([`HotplugCtx::set_agent_hostname`]).
async fn guest_os_info(ctx: &HotplugCtx, ns: &str, name: &str) -> Reply {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), ns);
    let vmi = match vmis.get_opt(name).await {
        Ok(Some(vmi)) => vmi,
        Ok(None) => {
            return get_handler_error(format!(
                "virtualmachineinstance.kubevirt.io \"{name}\" not found"
            ));
        }
        Err(e) => {
            return get_handler_error(format!(
                "Internal error occurred: unable to retrieve vmi [{name}]: {e}"
            ));
        }
    };
    let not_fulfilled = |text: &str| {
        get_handler_error(format!(
            "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"{name}\": {text}"
        ))
    };
    if vmi.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
        return not_fulfilled(VMI_NOT_RUNNING);
    }
    let connected = vmi
        .status
        .as_ref()
        .and_then(|s| s.rest.get("conditions"))
        .and_then(|c| c.as_array())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.get("type").and_then(|t| t.as_str()) == Some("AgentConnected"))
        });
    if !connected {
        return not_fulfilled(VMI_NO_AGENT);
    }
    let hostname = match ctx.vm(name) {
        Some(backend) => match backend.agent_host_name().await {
            Ok(h) => h,
            Err(e) => {
                return get_handler_error(format!("guest agent of {ns}/{name}: {e}"));
            }
        },
        None => ctx.agent_hostname(ns, name).unwrap_or_default(),
    };
    let mut info = json!({
        "guestAgentVersion": "8.2.2",
        "os": {"name": "Ubuntu", "id": "ubuntu", "version": "24.04", "versionId": "24.04",
               "prettyName": "Ubuntu 24.04 LTS", "machine": "x86_64"},
    });
    if !hostname.is_empty() {
        info["hostname"] = json!(hostname);
    }
    reply(StatusCode::OK, info)
}

/// An API server error relayed whole, as virt-api's `writeError` writes the `StatusError` it
/// got (kubevirt/kubevirt v1.7.0 `pkg/virt-api/rest/subresource.go`): `details.causes` of an
/// admission webhook's refusal included.
fn api_error(e: kube::Error) -> Reply {
    match e {
        kube::Error::Api(s) => {
            let code = StatusCode::from_u16(s.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            match serde_json::to_value(&s) {
                Ok(mut body) if body.is_object() => {
                    body["kind"] = json!("Status");
                    body["apiVersion"] = json!("v1");
                    reply(code, body)
                }
                _ => failure(code, &s.reason, s.message),
            }
        }
        other => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            other.to_string(),
        ),
    }
}

/// A 409 as virt-api words a volume conflict: `errors.NewConflict(v1.Resource("virtualmachine"),
/// name, err)` (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-api/rest/volumes.go`).
fn conflict(vm: &str, text: String) -> Reply {
    failure(
        StatusCode::CONFLICT,
        "Conflict",
        format!("Operation cannot be fulfilled on virtualmachine.kubevirt.io \"{vm}\": {text}"),
    )
}

/// virt-api's `verifyVolumeOption` against the VM spec's volumes: the name or the claim in use
/// (add), a volume that does not exist or is not hot-pluggable (remove).
fn verify_volume_option(
    spec: &harvester_common::harvester::kubevirt::VmiSpec,
    add: Option<(&str, &str)>,
    remove: Option<&str>,
) -> Result<(), String> {
    for v in &spec.volumes {
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|p| p.claim_name.as_str());
        if let Some((name, source)) = add {
            if v.name == name {
                return Err(format!(
                    "Unable to add volume [{name}] because volume with that name already exists"
                ));
            }
            if claim == Some(source) {
                return Err(format!(
                    "Unable to add volume source [{source}] because it already exists"
                ));
            }
        } else if let Some(name) = remove
            && (v.name == name || claim == Some(name))
        {
            let hotpluggable = v
                .persistent_volume_claim
                .as_ref()
                .and_then(|p| p.hotpluggable)
                == Some(true);
            if !hotpluggable {
                return Err(format!(
                    "Unable to remove volume [{}] because it is not hotpluggable",
                    v.name
                ));
            }
            return Ok(());
        }
    }
    match remove {
        Some(name) => Err(format!(
            "Unable to remove volume [{name}] because it does not exist"
        )),
        None => Ok(()),
    }
}

/// The VM's `status.volumeRequests`, raw as stored (`null` when missing, which a JSON patch
/// `test` passes only while it is missing).
fn volume_requests(vm: &VirtualMachine) -> serde_json::Value {
    vm.status
        .as_ref()
        .and_then(|s| s.rest.get("volumeRequests"))
        .cloned()
        .unwrap_or_default()
}

fn request_name(r: &serde_json::Value, kind: &str) -> Option<String> {
    r.get(kind)?.get("name")?.as_str().map(str::to_string)
}

/// virt-api under `HotplugVolumes`: the request is appended to the VM's `status.volumeRequests`
/// by a JSON patch that `test`s the list as read (`vmVolumePatchStatus`,
/// `generateVMVolumeRequestPatch`); virt-controller applies it later ([`apply_volume_requests`]).
/// A lost race is the API server's 422, relayed; any other failure a 500.
async fn request_in_status(
    ctx: &HotplugCtx,
    ns: &str,
    vm: &VirtualMachine,
    request: serde_json::Value,
) -> Reply {
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let old = volume_requests(vm);
    let existing = old.as_array().cloned().unwrap_or_default();
    let mut list = Vec::new();
    if let Some(name) = request_name(&request, "addVolumeOptions") {
        for r in &existing {
            if request_name(r, "addVolumeOptions").as_deref() == Some(&name) {
                return conflict(
                    &vm_name,
                    format!("add volume request for volume [{name}] already exists"),
                );
            }
            if request_name(r, "removeVolumeOptions").as_deref() == Some(&name) {
                return conflict(
                    &vm_name,
                    format!(
                        "unable to add volume since a remove volume request for volume [{name}] already exists and is still being processed"
                    ),
                );
            }
        }
        list = existing;
    } else if let Some(name) = request_name(&request, "removeVolumeOptions") {
        for r in existing {
            if request_name(&r, "addVolumeOptions").as_deref() == Some(&name) {
                continue;
            }
            if request_name(&r, "removeVolumeOptions").as_deref() == Some(&name) {
                return conflict(
                    &vm_name,
                    format!(
                        "a remove volume request for volume [{name}] already exists and is still being processed"
                    ),
                );
            }
            list.push(r);
        }
    }
    list.push(request);
    let op = if old.as_array().is_some_and(|l| !l.is_empty()) {
        "replace"
    } else {
        "add"
    };
    let patch = json!([
        {"op": "test", "path": "/status/volumeRequests", "value": old},
        {"op": op, "path": "/status/volumeRequests", "value": list},
    ]);
    let patched = hotplug::patch_vm_at(&ctx.client, ns, &vm_name, Some("status"), &patch).await;
    accepted_or(patched, "vm status")
}

/// virt-api's answer to its own VM patch: 202 when stored, the API server's 422 (a lost `test`,
/// or an admission webhook's refusal) relayed whole, anything else 500 `unable to patch <what>`.
fn accepted_or(patched: Result<VirtualMachine, kube::Error>, what: &str) -> Reply {
    match patched {
        Ok(_) => reply(StatusCode::ACCEPTED, json!({})),
        Err(kube::Error::Api(s)) if s.code == 422 => api_error(kube::Error::Api(s)),
        Err(e) => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            format!("unable to patch {what}: {e}"),
        ),
    }
}

/// virt-api under `DeclarativeHotplugVolumes` alone: the VM spec itself is JSON-patched, with a
/// `test` of the volume and disk lists as read (`vmVolumePatch`, `generateVolumeRequestPatch`);
/// virt-controller's declarative hot-plug acts on the spec ([`sync_declarative`]).
async fn patch_spec(
    ctx: &HotplugCtx,
    ns: &str,
    vm_name: &str,
    plan: impl FnOnce(&serde_json::Value) -> Option<serde_json::Value>,
) -> Reply {
    let spec = match hotplug::vm_template_spec(&ctx.client, ns, vm_name).await {
        Ok(Some(spec)) => spec,
        Ok(None) => {
            return failure(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("virtualmachine.kubevirt.io \"{vm_name}\" not found"),
            );
        }
        Err(e) => return api_error(e),
    };
    let Some(patch) = plan(&spec) else {
        return reply(StatusCode::ACCEPTED, json!({}));
    };
    accepted_or(
        hotplug::patch_vm(&ctx.client, ns, vm_name, &patch).await,
        "vm",
    )
}

/// virt-api's VM `addvolume` (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/virt-api/rest/volumes.go`
/// `addVolumeRequestHandler`): checked against the VM spec, then a status request
/// (`HotplugVolumes` on) or a spec patch (declarative gate alone); 202 when stored.
async fn add_volume(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    opts: AddVolumeOptions,
    gates: Gates,
) -> Reply {
    let Some(claim) = opts.claim_name().map(str::to_string) else {
        return failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "AddVolumeOptions requires VolumeSource to not be nil".into(),
        );
    };
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), ns);
    let vm = match vms.get(vm_name).await {
        Ok(vm) => vm,
        Err(e) => return api_error(e),
    };
    if let Err(text) =
        verify_volume_option(&vm.spec.template.spec, Some((&opts.name, &claim)), None)
    {
        return conflict(vm_name, text);
    }
    let serial = opts
        .disk
        .serial
        .clone()
        .unwrap_or_else(|| opts.name.clone());
    if gates.hotplug_volumes {
        // As virt-api stores it: the disk named like the volume, the claim hot-pluggable.
        let mut add = serde_json::to_value(&opts).unwrap_or_default();
        add["disk"]["name"] = json!(opts.name);
        add["volumeSource"]["persistentVolumeClaim"]["hotpluggable"] = json!(true);
        return request_in_status(ctx, ns, &vm, json!({"addVolumeOptions": add})).await;
    }
    patch_spec(ctx, ns, vm_name, |spec| {
        let mut patch = hotplug::declarative_add_patch(spec, &opts.name, &claim, &serial)?;
        // virt-api stores the caller's disk device (`generateVolumeRequestPatch` appends
        // `opts.Disk`): its bus goes into the spec as asked, for the admitters to judge.
        if !opts.disk.disk.is_null() {
            with_disk_device(&mut patch, &opts.name, &opts.disk.disk);
        }
        Some(patch)
    })
    .await
}

/// Sets the device (`disk: {bus}`) of the disk named `name` wherever `patch` adds it.
fn with_disk_device(patch: &mut serde_json::Value, name: &str, device: &serde_json::Value) {
    match patch {
        serde_json::Value::Array(items) => {
            for item in items {
                with_disk_device(item, name, device);
            }
        }
        serde_json::Value::Object(map) => {
            if map.get("name").and_then(|n| n.as_str()) == Some(name) && map.contains_key("disk") {
                map.insert("disk".into(), device.clone());
                return;
            }
            for v in map.values_mut() {
                with_disk_device(v, name, device);
            }
        }
        _ => {}
    }
}

/// virt-controller's part of a hot-plug into a running VMI (its callers check): the VMI gets the
/// volume in its spec and a Pending volumeStatus, then (in the background) [`attach`]. Recorded
/// as [`VMI_ADD`] when the VMI took it.
async fn plug_into_vmi(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    volume: Volume,
    disk: Disk,
    claim: &str,
    serial: &str,
) -> Result<(), kube::Error> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), ns);
    let updated = update_vmi(&vmis, vm_name, |vmi| {
        vmi.spec.volumes.retain(|v| v.name != volume.name);
        vmi.spec.volumes.push(volume.clone());
        vmi.spec
            .domain
            .devices
            .disks
            .retain(|d| d.name != disk.name);
        vmi.spec.domain.devices.disks.push(disk.clone());
        let status = vmi.status.get_or_insert_with(Default::default);
        status.volume_status.retain(|s| s.name != volume.name);
        status.volume_status.push(VolumeStatus {
            name: volume.name.clone(),
            phase: Some("Pending".into()),
            hotplug_volume: Some(json!({"attachPodName": format!("hp-volume-{}", volume.name)})),
            persistent_volume_claim_info: Some(json!({"claimName": claim})),
            ..Default::default()
        });
    })
    .await?;
    if let Some(vmi) = updated {
        ctx.record(VMI_ADD, ns, vm_name, &volume.name);
        let ctx = ctx.clone();
        let (ns, vm_name, name) = (ns.to_string(), vm_name.to_string(), volume.name.clone());
        let (claim, serial) = (claim.to_string(), serial.to_string());
        let node = vmi_guest_node(&vmi, &vm_name);
        tokio::spawn(async move {
            if let Err(e) = attach(&ctx, &ns, &vm_name, &name, &claim, &serial, &node).await {
                tracing::warn!("sim hotplug of {ns}/{name} into {vm_name}: {e}");
            }
        });
    }
    Ok(())
}

fn hotplug_entries(opts: &AddVolumeOptions, claim: &str, serial: &str) -> (Volume, Disk) {
    let volume = Volume {
        name: opts.name.clone(),
        persistent_volume_claim: Some(PvcVolumeSource {
            claim_name: claim.to_string(),
            hotpluggable: Some(true),
            rest: Rest::new(),
        }),
        rest: Rest::new(),
    };
    let mut disk_rest = Rest::new();
    disk_rest.insert(
        "disk".into(),
        if opts.disk.disk.is_null() {
            json!({"bus": "scsi"})
        } else {
            opts.disk.disk.clone()
        },
    );
    let disk = Disk {
        name: opts.name.clone(),
        serial: Some(serial.to_string()),
        rest: disk_rest,
    };
    (volume, disk)
}

/// The guest node a VMI's disks show up on: the VM name (guest node name = VM name).
fn vmi_guest_node(vmi: &VirtualMachineInstance, vm_name: &str) -> String {
    vmi.metadata
        .name
        .clone()
        .unwrap_or_else(|| vm_name.to_string())
}

/// The phases of a hot-plugged volume as virt-handler and virt-controller report them
/// (kubevirt/kubevirt v1.7.0 `staging/src/kubevirt.io/api/core/v1/types.go`, `pkg/virt-handler/vm.go`):
/// Pending -> Bound (the claim has a volume) -> AttachedToNode -> MountedToPod -> Ready (with the
/// domain's target, reason `VolumeReady`), and the by-id link appears in the guest. Each step
/// happens only while the VMI spec still has the volume (an unplug may come meanwhile).
async fn attach(
    ctx: &HotplugCtx,
    ns: &str,
    vm_name: &str,
    name: &str,
    claim: &str,
    serial: &str,
    node: &str,
) -> Result<(), String> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), ns);
    // The hot-plug pod waits for its volume like KubeVirt's does.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let backing = loop {
        if let Some(b) = ctx.storage.get(ns, claim) {
            break b;
        }
        if tokio::time::Instant::now() > deadline {
            set_phase(&vmis, vm_name, name, "Pending", Some("PVC is not bound")).await?;
            return Err(format!("PVC {ns}/{claim} never got a volume"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    set_phase(&vmis, vm_name, name, "Bound", None).await?;
    tokio::time::sleep(ctx.delay / 2).await;
    set_phase(&vmis, vm_name, name, "AttachedToNode", None).await?;
    tokio::time::sleep(ctx.delay / 2).await;
    let vmi = vmis.get_opt(vm_name).await.map_err(|e| e.to_string())?;
    if !vmi.as_ref().is_some_and(|v| in_spec(v, name)) {
        // Removed (removevolume) while it was attaching: the guest never sees the disk.
        return Ok(());
    }
    set_phase(&vmis, vm_name, name, "MountedToPod", None).await?;
    let target = match ctx.vm(node) {
        Some(vm) => match plug_into_vm(ctx, &vm, ns, claim, name, serial, &backing.device).await {
            Ok(t) => t,
            Err(e) => {
                set_phase(&vmis, vm_name, name, "MountedToPod", Some(&e)).await?;
                return Err(e);
            }
        },
        None => {
            let dir = ctx.by_id_dir(node);
            link_disk(&dir, serial, &backing.device).map_err(|e| e.to_string())?;
            next_target(vmi.as_ref(), name)
        }
    };
    let still_wanted = vmis
        .get_opt(vm_name)
        .await
        .map_err(|e| e.to_string())?
        .is_some_and(|v| in_spec(&v, name));
    if !still_wanted {
        // removevolume came while the disk was being plugged: take it out again.
        if let Some(vm) = ctx.vm(node) {
            unplug_from_vm(ctx, &vm, ns, claim, name).await?;
        }
        return Ok(());
    }
    set_phase(&vmis, vm_name, name, VOLUME_READY, Some(&target)).await
}

/// Whether the VMI spec has volume `name`.
fn in_spec(vmi: &VirtualMachineInstance, name: &str) -> bool {
    vmi.spec.volumes.iter().any(|v| v.name == name)
}

/// QMP `blockdev-add` + `device_add scsi-hd` of the claim's device into the VM, then waits until
/// the guest kernel has the disk (as virt-handler reports Ready once the domain has it); the
/// target is the guest's disk name.
pub(crate) async fn plug_into_vm(
    ctx: &HotplugCtx,
    vm: &Arc<Vm>,
    ns: &str,
    claim: &str,
    name: &str,
    serial: &str,
    device: &Path,
) -> Result<String, String> {
    let id = device_id(name);
    let t0 = tokio::time::Instant::now();
    vm.plug(&id, device, serial)
        .await
        .map_err(|e| e.to_string())?;
    ctx.storage.mark_plugged(ns, claim, vm.clone(), &id);
    let target = vm
        .wait_for_disk(serial, GUEST_DISK_WAIT)
        .await
        .map_err(|e| e.to_string())?;
    let took = t0.elapsed();
    vm.stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .plug_to_guest
        .push(took);
    tracing::info!(vm = %vm.name, %serial, %target, "hot-plugged in {took:?}");
    Ok(target)
}

pub(crate) async fn unplug_from_vm(
    ctx: &HotplugCtx,
    vm: &Vm,
    ns: &str,
    claim: &str,
    name: &str,
) -> Result<(), String> {
    let id = device_id(name);
    if !vm.is_plugged(&id) {
        return Ok(());
    }
    let seen = vm.unplug(&id).await.map_err(|e| e.to_string())?;
    ctx.storage.mark_unplugged(ns, claim);
    tracing::info!(vm = %vm.name, %id, "unplugged ({seen})");
    Ok(())
}

/// `sda` is the boot disk; hot-plugged disks take the next free letters.
fn next_target(vmi: Option<&VirtualMachineInstance>, name: &str) -> String {
    let used: Vec<String> = vmi
        .and_then(|v| v.status.as_ref())
        .map(|s| {
            s.volume_status
                .iter()
                .filter(|v| v.name != name)
                .map(|v| v.target.clone())
                .collect()
        })
        .unwrap_or_default();
    (b'b'..=b'z')
        .map(|c| format!("sd{}", c as char))
        .find(|t| !used.contains(t))
        .unwrap_or_else(|| "sdz".into())
}

/// Sets the phase of volume `name`'s status while the VMI spec still has it (an attach step).
async fn set_phase(
    vmis: &Api<VirtualMachineInstance>,
    vm_name: &str,
    name: &str,
    phase: &str,
    target_or_message: Option<&str>,
) -> Result<(), String> {
    update_vmi(vmis, vm_name, |vmi| {
        if !in_spec(vmi, name) {
            return;
        }
        if let Some(s) = vmi
            .status
            .as_mut()
            .and_then(|s| s.volume_status.iter_mut().find(|v| v.name == name))
        {
            s.phase = Some(phase.to_string());
            match (phase, target_or_message) {
                (VOLUME_READY, Some(t)) => {
                    s.target = t.to_string();
                    s.reason = Some("VolumeReady".into());
                    s.message = Some(format!(
                        "Successfully attach hotplugged volume {name} to VM"
                    ));
                }
                (_, Some(m)) => s.message = Some(m.to_string()),
                _ => {}
            }
        }
    })
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// GET-modify-PUT of a VMI, retried (50 times at most, then the error) on conflicts and on what
/// passes: an API server or webhook that failed or timed out, a dropped connection (virt-handler
/// and virt-controller requeue such a failure, `AddRateLimited`); `Ok(None)` when there is no VMI.
pub async fn update_vmi(
    vmis: &Api<VirtualMachineInstance>,
    name: &str,
    mut change: impl FnMut(&mut VirtualMachineInstance),
) -> Result<Option<VirtualMachineInstance>, kube::Error> {
    let mut attempt = 0u64;
    loop {
        let result = match vmis.get_opt(name).await {
            Ok(Some(mut vmi)) => {
                change(&mut vmi);
                vmis.replace(name, &PostParams::default(), &vmi)
                    .await
                    .map(Some)
            }
            other => other,
        };
        let e = match result {
            Err(e) if attempt < 50 => e,
            other => return other,
        };
        attempt += 1;
        let wait = match retriable(&e) {
            // Several hot-plugs of one VMI update it at once: back off, spread by the attempt.
            Some(Retry::Conflict) => {
                let spread = u64::from(std::process::id()).wrapping_add(attempt * 7919) % 20;
                Duration::from_millis(attempt.min(10) * 5 + spread)
            }
            Some(Retry::Transient) => Duration::from_millis(100 * attempt.min(10)),
            None => return Err(e),
        };
        tracing::debug!("sim VMI {name}: {e}; again in {wait:?}");
        tokio::time::sleep(wait).await;
    }
}

/// Why a failed request may succeed when sent again.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Retry {
    /// 409: the object changed since it was read.
    Conflict,
    /// 429, 5xx (a webhook timed out, etcd was slow) or the connection failed.
    Transient,
}

fn retriable(e: &kube::Error) -> Option<Retry> {
    match e {
        kube::Error::Api(s) if s.code == 409 => Some(Retry::Conflict),
        kube::Error::Api(s) if s.code == 429 || s.code >= 500 => Some(Retry::Transient),
        kube::Error::HyperError(_) | kube::Error::Service(_) => Some(Retry::Transient),
        _ => None,
    }
}

pub fn link_disk(dir: &Path, serial: &str, device: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let link = dir.join(format!("{BY_ID_PREFIX}{serial}"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(device, link)
}

/// virt-api's VM `removevolume` (`removeVolumeRequestHandler`): checked against the VM spec, then
/// a status request or a spec patch, as [`add_volume`].
async fn remove_volume(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    opts: RemoveVolumeOptions,
    gates: Gates,
) -> Reply {
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), ns);
    let vm = match vms.get(vm_name).await {
        Ok(vm) => vm,
        Err(e) => return api_error(e),
    };
    if let Err(text) = verify_volume_option(&vm.spec.template.spec, None, Some(&opts.name)) {
        return conflict(vm_name, text);
    }
    if gates.hotplug_volumes {
        return request_in_status(
            ctx,
            ns,
            &vm,
            json!({"removeVolumeOptions": {"name": opts.name}}),
        )
        .await;
    }
    patch_spec(ctx, ns, vm_name, |spec| {
        hotplug::declarative_remove_patch(spec, &opts.name)
    })
    .await
}

/// KubeVirt's part of a hot-unplug from a running VMI: a real guest loses the disk first; the
/// volume leaves the VMI spec while its status goes on, Detaching then UnMountedFromPod, and
/// goes last (kubevirt/kubevirt v1.7.0 `pkg/virt-handler/vm.go`: the status outlives the spec
/// entry). A stopped VMI keeps its disks: KubeVirt unplugs from running VMIs only. Recorded as
/// [`VMI_REMOVE`].
async fn unplug_from_vmi(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    name: &str,
    claim: &str,
    serial: &str,
) -> Result<(), Reply> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), ns);
    let running = match vmis.get_opt(vm_name).await {
        Ok(v) => {
            v.is_some_and(|v| v.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        }
        Err(e) => return Err(api_error(e)),
    };
    if !running {
        return Ok(());
    }
    if let Some(backend) = ctx.vm(vm_name)
        && let Err(e) = unplug_from_vm(ctx, &backend, ns, claim, name).await
    {
        return Err(failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            e,
        ));
    }
    let mut node = None;
    update_vmi(&vmis, vm_name, |vmi| {
        node = Some(vmi_guest_node(vmi, vm_name));
        vmi.spec.volumes.retain(|v| v.name != name);
        vmi.spec.domain.devices.disks.retain(|d| d.name != name);
        if let Some(s) = vmi
            .status
            .as_mut()
            .and_then(|s| s.volume_status.iter_mut().find(|v| v.name == name))
        {
            s.phase = Some("Detaching".into());
        }
    })
    .await
    .map_err(api_error)?;
    ctx.record(VMI_REMOVE, ns, vm_name, name);
    if let Some(node) = node {
        let _ = std::fs::remove_file(ctx.by_id_dir(&node).join(format!("{BY_ID_PREFIX}{serial}")));
    }
    let ctx = ctx.clone();
    let (ns, vm_name, name) = (ns.to_string(), vm_name.to_string(), name.to_string());
    tokio::spawn(async move {
        if let Err(e) = finish_unplug(&ctx, &ns, &vm_name, &name).await {
            tracing::warn!("sim hot-unplug of {ns}/{name} from {vm_name}: {e}");
        }
    });
    Ok(())
}

/// The rest of an unplug: UnMountedFromPod, then the status entry goes (unless the volume came
/// back into the spec meanwhile). The VMI change wakes [`run_controller`] for its VM, which adds a
/// volume again that waited for the old status to go.
async fn finish_unplug(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    name: &str,
) -> Result<(), String> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), ns);
    let step = (ctx.delay / 2).max(Duration::from_millis(50));
    for phase in ["UnMountedFromPod", ""] {
        tokio::time::sleep(step).await;
        update_vmi(&vmis, vm_name, |vmi| {
            if in_spec(vmi, name) {
                return;
            }
            if let Some(s) = vmi.status.as_mut() {
                if phase.is_empty() {
                    s.volume_status.retain(|v| v.name != name);
                } else if let Some(v) = s.volume_status.iter_mut().find(|v| v.name == name) {
                    v.phase = Some(phase.into());
                }
            }
        })
        .await
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The hot-plugged PVC volumes of a VM or VMI spec: `(volume, its disk, claim, serial)`. A disk
/// without a serial (upstream's driver sets none) is found by its name.
fn hotplugged(
    spec: &harvester_common::harvester::kubevirt::VmiSpec,
) -> Vec<(Volume, Disk, String, String)> {
    spec.volumes
        .iter()
        .filter_map(|v| {
            let pvc = v.persistent_volume_claim.as_ref()?;
            (pvc.hotpluggable == Some(true)).then_some(())?;
            let disk = spec
                .domain
                .devices
                .disks
                .iter()
                .find(|d| d.name == v.name)?;
            let serial = disk.serial.clone().unwrap_or_else(|| v.name.clone());
            Some((v.clone(), disk.clone(), pvc.claim_name.clone(), serial))
        })
        .collect()
}

/// virt-controller's VM loop, for the part that hot-plugs: on every VM change, the VM's
/// `status.volumeRequests` are applied while `HotplugVolumes` is on ([`apply_volume_requests`]),
/// and the VM spec's hot-plugged volumes are carried into the VMI under the declarative gate alone
/// ([`sync_declarative`]). Runs for the whole bed.
pub async fn run_controller(ctx: Arc<HotplugCtx>) {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    // virt-controller's VM loop is woken by its VMs and by their VMIs; it decides from the VM as
    // it is now (an event may be older than the VMI it would be compared with).
    let vms: Api<VirtualMachine> = Api::all(ctx.client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::all(ctx.client.clone());
    let key =
        |m: kube::api::ObjectMeta| (m.namespace.unwrap_or_default(), m.name.unwrap_or_default());
    // Under HotplugVolumes alone, a pass may apply something only for a VM with requests, or
    // when its VMI runs (requests wait for that).
    let by_vm = super::watch(vms).applied_objects().map(move |e| {
        e.map(|vm| {
            let requests = volume_requests(&vm)
                .as_array()
                .is_some_and(|r| !r.is_empty());
            (requests, key(vm.metadata))
        })
    });
    let by_vmi = super::watch(vmis).applied_objects().map(move |e| {
        e.map(|vmi| {
            let running = vmi.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            (running, key(vmi.metadata))
        })
    });
    // A VM whose sync failed comes again after a back-off that doubles per failure
    // (kubevirt/kubevirt v1.7.0 `pkg/virt-controller/watch/vm/vm.go` `Execute`:
    // `c.Queue.AddRateLimited(key)` on an error), as if it had changed.
    let (requeue, requeued) = futures::channel::mpsc::unbounded::<(String, String)>();
    let requeued = requeued.map(|key| Ok((true, key)));
    let mut stream = std::pin::pin!(futures::stream::select(
        futures::stream::select(by_vm, by_vmi),
        requeued
    ));
    let mut failures: HashMap<(String, String), u32> = HashMap::new();
    while let Some(event) = stream.next().await {
        let key = match event {
            // The declarative hot-plug decides from the VM spec and the VMI's volumes.
            Ok((_, key)) if ctx.gates().declarative_controller() => key,
            Ok((true, key)) if ctx.gates().hotplug_volumes => key,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!("sim virt-controller: watch: {e}");
                continue;
            }
        };
        match sync_vm(&ctx, &key.0, &key.1).await {
            Ok(()) => {
                failures.remove(&key);
            }
            Err(e) => {
                let n = failures.entry(key.clone()).or_default();
                *n += 1;
                let wait = Duration::from_millis(100 << (*n).min(6));
                tracing::warn!(
                    "sim virt-controller, VM {}/{}: {e}; again in {wait:?}",
                    key.0,
                    key.1
                );
                let requeue = requeue.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    let _ = requeue.unbounded_send(key);
                });
            }
        }
    }
}

/// One pass of virt-controller's VM loop over the VM as it is now: its volume requests under
/// `HotplugVolumes`, its spec's hot-plugged volumes under the declarative gate alone.
async fn sync_vm(ctx: &Arc<HotplugCtx>, ns: &str, name: &str) -> Result<(), String> {
    let vm = Api::<VirtualMachine>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?;
    let Some(vm) = vm else {
        return Ok(());
    };
    let gates = ctx.gates();
    if gates.hotplug_volumes {
        apply_volume_requests(ctx, &vm).await
    } else if gates.declarative_controller() {
        sync_declarative(ctx, &vm).await
    } else {
        Ok(())
    }
}

/// `HotplugVolumes`: each request of `status.volumeRequests` is applied to the VM spec and, for a
/// VMI that lacks (add) or has (remove) the volume, to the VMI through virt-api's VMI
/// `addvolume`/`removevolume`, which refuse a VMI that is not running ([`VMI_NOT_RUNNING`]); one
/// refusal fails the pass and the spec is not stored. Then the requests the stored spec reflects
/// are trimmed, after a failed pass too (kubevirt/kubevirt v1.6.1, v1.7.0, v1.8.0
/// `pkg/virt-controller/watch/vm/vm.go` `handleVolumeRequests`, `execute` -> `updateStatus` ->
/// `trimDoneVolumeRequests`; `pkg/virt-api/rest/volumes.go` `vmiVolumePatch`).
async fn apply_volume_requests(ctx: &Arc<HotplugCtx>, vm: &VirtualMachine) -> Result<(), String> {
    let requests = volume_requests(vm);
    let Some(requests) = requests.as_array().filter(|r| !r.is_empty()) else {
        return Ok(());
    };
    let ns = vm.metadata.namespace.clone().unwrap_or_default();
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let vmi = vmis.get_opt(&vm_name).await.map_err(|e| e.to_string())?;
    // A VMI being deleted is left alone; the requests go to the VM spec only.
    let vmi = vmi.filter(|v| v.metadata.deletion_timestamp.is_none());
    let running = vmi
        .as_ref()
        .and_then(|v| v.status.as_ref())
        .and_then(|s| s.phase.as_deref())
        == Some("Running");
    let refused = || format!("VMI {ns}/{vm_name}: {VMI_NOT_RUNNING}");
    let mut failed = None;
    let mut spec = vm.spec.template.spec.clone();
    for r in requests {
        if let Some(add) = r.get("addVolumeOptions") {
            let opts: AddVolumeOptions = serde_json::from_value(add.clone())
                .map_err(|e| format!("addVolumeOptions: {e}"))?;
            let claim = opts.claim_name().unwrap_or_default().to_string();
            let serial = opts
                .disk
                .serial
                .clone()
                .unwrap_or_else(|| opts.name.clone());
            let (volume, disk) = hotplug_entries(&opts, &claim, &serial);
            if !spec.volumes.iter().any(|v| v.name == opts.name) {
                spec.volumes.push(volume.clone());
                spec.domain.devices.disks.retain(|d| d.name != opts.name);
                spec.domain.devices.disks.push(disk.clone());
            }
            if vmi.as_ref().is_some_and(|v| !in_spec(v, &opts.name)) {
                if !running {
                    failed = Some(refused());
                    break;
                }
                plug_into_vmi(ctx, &ns, &vm_name, volume, disk, &claim, &serial)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        } else if let Some(name) = request_name(r, "removeVolumeOptions") {
            let found = hotplugged(&spec).into_iter().find(|h| h.0.name == name);
            spec.volumes.retain(|v| v.name != name);
            spec.domain.devices.disks.retain(|d| d.name != name);
            if vmi.as_ref().is_some_and(|v| in_spec(v, &name)) {
                if !running {
                    failed = Some(refused());
                    break;
                }
                if let Some((_, _, claim, serial)) = found {
                    unplug_from_vmi(ctx, &ns, &vm_name, &name, &claim, &serial)
                        .await
                        .map_err(|_| format!("unplugging {name} failed"))?;
                }
            }
        }
    }
    let stored = match failed {
        None => match store_spec(ctx, vm, spec).await? {
            Some(stored) => stored,
            // Changed meanwhile: the watch brings the new version, and this runs again.
            None => return Ok(()),
        },
        Some(_) => vm.clone(),
    };
    trim_done_requests(ctx, &stored, requests).await?;
    failed.map_or(Ok(()), Err)
}

/// Stores `spec` as VM `vm`'s template spec; `None` when the VM changed since it was read.
async fn store_spec(
    ctx: &HotplugCtx,
    vm: &VirtualMachine,
    spec: harvester_common::harvester::kubevirt::VmiSpec,
) -> Result<Option<VirtualMachine>, String> {
    let ns = vm.metadata.namespace.clone().unwrap_or_default();
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let mut updated = vm.clone();
    updated.spec.template.spec = spec;
    match vms
        .replace(&vm_name, &PostParams::default(), &updated)
        .await
    {
        Ok(v) => Ok(Some(v)),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// virt-controller's `trimDoneVolumeRequests`: drops from `status.volumeRequests` (as read:
/// `requests`) each add whose volume and disk the stored VM spec has, each remove whose volume
/// and disk it lacks.
async fn trim_done_requests(
    ctx: &HotplugCtx,
    stored: &VirtualMachine,
    requests: &[serde_json::Value],
) -> Result<(), String> {
    let ns = stored.metadata.namespace.clone().unwrap_or_default();
    let vm_name = stored.metadata.name.clone().unwrap_or_default();
    let left: Vec<serde_json::Value> = requests
        .iter()
        .filter(|r| {
            let spec = &stored.spec.template.spec;
            let has = |n: &str| {
                spec.volumes.iter().any(|v| v.name == n)
                    && spec.domain.devices.disks.iter().any(|d| d.name == n)
            };
            let gone = |n: &str| {
                !spec.volumes.iter().any(|v| v.name == n)
                    && !spec.domain.devices.disks.iter().any(|d| d.name == n)
            };
            match (
                request_name(r, "addVolumeOptions"),
                request_name(r, "removeVolumeOptions"),
            ) {
                (Some(n), _) => !has(&n),
                (_, Some(n)) => !gone(&n),
                _ => true,
            }
        })
        .cloned()
        .collect();
    if left.len() == requests.len() {
        return Ok(());
    }
    let patch = json!([
        {"op": "test", "path": "/status/volumeRequests", "value": requests},
        {"op": "replace", "path": "/status/volumeRequests", "value": left},
    ]);
    match hotplug::patch_vm_at(&ctx.client, &ns, &vm_name, Some("status"), &patch).await {
        // A new request came meanwhile: the next event trims again.
        Ok(_) | Err(kube::Error::Api(_)) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// virt-controller under `DeclarativeHotplugVolumes` alone: the hot-plugged volumes of a running
/// VMI follow the VM spec (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/storage/hotplug/hotplug.go`
/// `HandleDeclarativeVolumes`): nothing for a VM whose `updateVolumesStrategy` is `Migration`; a
/// volume the VMI still reports a status for (an unplug not finished) is not added again yet
/// (`getNewHotplugVMVolumes`).
async fn sync_declarative(ctx: &Arc<HotplugCtx>, vm: &VirtualMachine) -> Result<(), String> {
    if vm.update_volumes_strategy()
        == Some(harvester_common::harvester::kubevirt::UPDATE_VOLUMES_MIGRATION)
    {
        return Ok(());
    }
    let ns = vm.metadata.namespace.clone().unwrap_or_default();
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(vmi) = vmis.get_opt(&vm_name).await.map_err(|e| e.to_string())? else {
        return Ok(());
    };
    if vmi.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
        return Ok(());
    }
    let wanted = hotplugged(&vm.spec.template.spec);
    let present = hotplugged(&vmi.spec);
    for (volume, disk, claim, serial) in &wanted {
        if !present.iter().any(|p| p.0.name == volume.name)
            && vmi.volume_status(&volume.name).is_none()
        {
            plug_into_vmi(
                ctx,
                &ns,
                &vm_name,
                volume.clone(),
                disk.clone(),
                claim,
                serial,
            )
            .await
            .map_err(|e| e.to_string())?;
        }
    }
    for (volume, _, claim, serial) in &present {
        if !wanted.iter().any(|w| w.0.name == volume.name) {
            unplug_from_vmi(ctx, &ns, &vm_name, &volume.name, claim, serial)
                .await
                .map_err(|_| format!("unplugging {} failed", volume.name))?;
        }
    }
    Ok(())
}
