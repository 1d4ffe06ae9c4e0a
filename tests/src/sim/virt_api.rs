//! virt-api's hot-plug subresources, served over HTTPS behind the real API aggregation layer.
//!
//! The aggregator authenticates and authorises the caller (RBAC on `virtualmachines/addvolume`),
//! then proxies here with the front-proxy client certificate, which this server requires. The
//! handlers then do what virt-api, virt-controller and virt-handler do together: update the VM and
//! VMI specs and, after `hotplug_delay`, the VMI's `volumeStatus` up to `Ready` plus the disk link
//! in the guest node's by-id directory.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
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
use crate::certs::Pki;
use crate::vm::{Vm, device_id};

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
    /// KubeVirt's `DeclarativeHotplugVolumes` gate (without `HotplugVolumes`): the subresources
    /// are refused and edits of a VM's spec hot-plug (see [`run_declarative`]).
    pub declarative: std::sync::atomic::AtomicBool,
}

/// [`HotplugCall::verb`] of a declarative hot-plug: the VM spec gained the volume.
pub const SPEC_ADD: &str = "spec-add";
/// [`HotplugCall::verb`] of a declarative hot-unplug: the VM spec lost the volume.
pub const SPEC_REMOVE: &str = "spec-remove";

/// How long a VM-backed hot-plug waits for the guest kernel to show the disk.
const GUEST_DISK_WAIT: Duration = Duration::from_secs(60);

/// One `addvolume` / `removevolume` request as virt-api received it, or one declarative change
/// of a VM's volumes as virt-controller saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotplugCall {
    /// `addvolume`, `removevolume`, [`SPEC_ADD`] or [`SPEC_REMOVE`].
    pub verb: String,
    pub namespace: String,
    pub vm: String,
    /// The volume name in the request (`AddVolumeOptions.name` / `RemoveVolumeOptions.name`).
    pub volume: String,
}

/// What virt-api answers (400 BadRequest) to `addvolume`/`removevolume` when the `HotplugVolumes`
/// feature gate is off, e.g. with only `DeclarativeHotplugVolumes` on: kubevirt/kubevirt
/// `pkg/virt-api/rest/subresource.go` `addVolumeRequestHandler`/`removeVolumeRequestHandler`, in
/// the releases whose handlers check `HotplugVolumesEnabled()` alone.
pub fn gate_refusal(verb: &str) -> &'static str {
    if verb == "addvolume" {
        "Unable to Add Volume because HotplugVolumes feature gate is not enabled."
    } else {
        "Unable to Remove Volume because HotplugVolumes feature gate is not enabled."
    }
}

impl HotplugCtx {
    /// Whether the declarative gate is on (subresources refused, VM spec edits hot-plug).
    pub fn is_declarative(&self) -> bool {
        self.declarative.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Turns the declarative gate on or off (a Harvester upgrade).
    pub fn set_declarative(&self, on: bool) {
        self.declarative
            .store(on, std::sync::atomic::Ordering::SeqCst);
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

    /// How many times volume `volume` was hot-plugged into VM `vm` the way the current gate says:
    /// `addvolume` requests, or (declarative) VM spec edits that added it, as virt-controller saw
    /// them.
    pub fn plugs(&self, vm: &str, volume: &str) -> usize {
        let verb = if self.is_declarative() {
            SPEC_ADD
        } else {
            "addvolume"
        };
        self.count(verb, vm, volume)
    }

    /// [`HotplugCtx::plugs`] for unplugging (`removevolume`, or spec edits that removed it).
    pub fn unplugs(&self, vm: &str, volume: &str) -> usize {
        let verb = if self.is_declarative() {
            SPEC_REMOVE
        } else {
            "removevolume"
        };
        self.count(verb, vm, volume)
    }

    /// How many `verb` requests for volume `volume` of VM `vm` virt-api has received.
    pub fn count(&self, verb: &str, vm: &str, volume: &str) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|c| c.verb == verb && c.vm == vm && c.volume == volume)
            .count()
    }

    fn record(&self, verb: &str, namespace: &str, vm: &str, volume: &str) {
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
        if ctx.is_declarative() && matches!(verb.as_str(), "addvolume" | "removevolume") {
            let name = match verb.as_str() {
                "addvolume" => serde_json::from_slice::<AddVolumeOptions>(&body).map(|o| o.name),
                _ => serde_json::from_slice::<RemoveVolumeOptions>(&body).map(|o| o.name),
            };
            ctx.record(&verb, &ns, &vm, &name.unwrap_or_default());
            return failure(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                gate_refusal(&verb).to_string(),
            );
        }
        return match verb.as_str() {
            "addvolume" => match serde_json::from_slice::<AddVolumeOptions>(&body) {
                Ok(opts) => {
                    ctx.record(&verb, &ns, &vm, &opts.name);
                    add_volume(&ctx, &ns, &vm, opts).await
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
                    remove_volume(&ctx, &ns, &vm, opts).await
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
        ]
    })
}

fn api_error(e: kube::Error) -> Reply {
    match e {
        kube::Error::Api(s) => {
            let code = StatusCode::from_u16(s.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            failure(code, &s.reason, s.message)
        }
        other => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            other.to_string(),
        ),
    }
}

async fn add_volume(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    opts: AddVolumeOptions,
) -> Reply {
    let Some(claim) = opts.claim_name().map(str::to_string) else {
        return failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "AddVolumeOptions.volumeSource.persistentVolumeClaim.claimName is required".into(),
        );
    };
    let serial = opts
        .disk
        .serial
        .clone()
        .unwrap_or_else(|| opts.name.clone());
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), ns);
    let mut vm = match vms.get(vm_name).await {
        Ok(vm) => vm,
        Err(e) => return api_error(e),
    };
    let tmpl = &mut vm.spec.template.spec;
    if tmpl.volumes.iter().any(|v| v.name == opts.name) {
        return failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!(
                "Unable to add volume [{}] because volume with that name already exists",
                opts.name
            ),
        );
    }
    let (volume, disk) = hotplug_entries(&opts, &claim, &serial);
    tmpl.volumes.push(volume.clone());
    tmpl.domain.devices.disks.push(disk.clone());
    if let Err(e) = vms.replace(vm_name, &PostParams::default(), &vm).await {
        return api_error(e);
    }
    match plug_into_vmi(ctx, ns, vm_name, volume, disk, &claim, &serial).await {
        Ok(()) => reply(StatusCode::ACCEPTED, json!({})),
        Err(e) => api_error(e),
    }
}

/// virt-controller's part of a hot-plug: a running VM's VMI gets the volume in its spec and a
/// Pending volumeStatus, then (in the background) [`attach`]. A stopped VM only keeps it in its
/// spec.
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

/// Pending -> AttachedToNode -> Ready (with a target), then the by-id link appears in the guest.
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
    tokio::time::sleep(ctx.delay / 2).await;
    set_phase(&vmis, vm_name, name, "AttachedToNode", None).await?;
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
    tokio::time::sleep(ctx.delay / 2).await;
    let vmi = vmis.get_opt(vm_name).await.map_err(|e| e.to_string())?;
    if vmi.as_ref().and_then(|v| v.volume_status(name)).is_none() {
        // Removed (removevolume) while it was attaching: the guest never sees the disk.
        return Ok(());
    }
    let target = match ctx.vm(node) {
        Some(vm) => match plug_into_vm(ctx, &vm, ns, claim, name, serial, &backing.device).await {
            Ok(t) => t,
            Err(e) => {
                set_phase(&vmis, vm_name, name, "AttachedToNode", Some(&e)).await?;
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
        .is_some_and(|v| v.volume_status(name).is_some());
    if !still_wanted {
        // removevolume came while the disk was being plugged: take it out again.
        if let Some(vm) = ctx.vm(node) {
            unplug_from_vm(ctx, &vm, ns, claim, name).await?;
        }
        return Ok(());
    }
    set_phase(&vmis, vm_name, name, VOLUME_READY, Some(&target)).await
}

/// QMP `blockdev-add` + `device_add scsi-hd` of the claim's device into the VM, then waits until
/// the guest kernel has the disk (as virt-handler reports Ready once the domain has it); the
/// target is the guest's disk name.
async fn plug_into_vm(
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

async fn unplug_from_vm(
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

async fn set_phase(
    vmis: &Api<VirtualMachineInstance>,
    vm_name: &str,
    name: &str,
    phase: &str,
    target_or_reason: Option<&str>,
) -> Result<(), String> {
    update_vmi(vmis, vm_name, |vmi| {
        if let Some(s) = vmi
            .status
            .as_mut()
            .and_then(|s| s.volume_status.iter_mut().find(|v| v.name == name))
        {
            s.phase = Some(phase.to_string());
            match (phase, target_or_reason) {
                (VOLUME_READY, Some(t)) => {
                    s.target = t.to_string();
                    s.reason = Some("VolumeReady".into());
                    s.message = Some("Successfully attach hotplugged volume to VM".into());
                }
                (_, Some(r)) => s.message = Some(r.to_string()),
                _ => {}
            }
        }
    })
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// GET-modify-PUT of a VMI, retried on conflicts; `Ok(None)` when there is no VMI.
pub async fn update_vmi(
    vmis: &Api<VirtualMachineInstance>,
    name: &str,
    mut change: impl FnMut(&mut VirtualMachineInstance),
) -> Result<Option<VirtualMachineInstance>, kube::Error> {
    for _ in 0..20 {
        let Some(mut vmi) = vmis.get_opt(name).await? else {
            return Ok(None);
        };
        change(&mut vmi);
        match vmis.replace(name, &PostParams::default(), &vmi).await {
            Ok(v) => return Ok(Some(v)),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e),
        }
    }
    vmis.get_opt(name).await
}

pub fn link_disk(dir: &Path, serial: &str, device: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let link = dir.join(format!("{BY_ID_PREFIX}{serial}"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(device, link)
}

async fn remove_volume(
    ctx: &Arc<HotplugCtx>,
    ns: &str,
    vm_name: &str,
    opts: RemoveVolumeOptions,
) -> Reply {
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), ns);
    let mut vm = match vms.get(vm_name).await {
        Ok(vm) => vm,
        Err(e) => return api_error(e),
    };
    let tmpl = &mut vm.spec.template.spec;
    let claim = tmpl
        .volumes
        .iter()
        .find(|v| v.name == opts.name)
        .and_then(|v| v.persistent_volume_claim.as_ref())
        .map(|p| p.claim_name.clone())
        .unwrap_or_default();
    let serial = tmpl
        .domain
        .devices
        .disks
        .iter()
        .find(|d| d.name == opts.name)
        .and_then(|d| d.serial.clone())
        .unwrap_or_else(|| opts.name.clone());
    let hotplugged = tmpl.volumes.iter().any(|v| {
        v.name == opts.name
            && v.persistent_volume_claim
                .as_ref()
                .and_then(|p| p.hotpluggable)
                == Some(true)
    });
    if !hotplugged {
        return failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!(
                "Unable to remove volume [{}] because it does not exist",
                opts.name
            ),
        );
    }
    tmpl.volumes.retain(|v| v.name != opts.name);
    tmpl.domain.devices.disks.retain(|d| d.name != opts.name);
    if let Err(e) = vms.replace(vm_name, &PostParams::default(), &vm).await {
        return api_error(e);
    }
    match unplug_from_vmi(ctx, ns, vm_name, &opts.name, &claim, &serial).await {
        Ok(()) => reply(StatusCode::ACCEPTED, json!({})),
        Err(e) => e,
    }
}

/// virt-handler's part of a hot-unplug: a running VMI loses the disk (a real guest first, as with
/// KubeVirt), then the volume leaves its spec and volumeStatus. A stopped VMI keeps its disks:
/// KubeVirt unplugs from running VMIs only.
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
    let res = update_vmi(&vmis, vm_name, |vmi| {
        node = Some(vmi_guest_node(vmi, vm_name));
        vmi.spec.volumes.retain(|v| v.name != name);
        vmi.spec.domain.devices.disks.retain(|d| d.name != name);
        if let Some(s) = vmi.status.as_mut() {
            s.volume_status.retain(|v| v.name != name);
        }
    })
    .await;
    if let Some(node) = node {
        let _ = std::fs::remove_file(ctx.by_id_dir(&node).join(format!("{BY_ID_PREFIX}{serial}")));
    }
    res.map(|_| ()).map_err(api_error)
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

/// virt-controller under `DeclarativeHotplugVolumes`: whenever a VM changes, the hot-plugged
/// volumes of its VMI follow its spec (added ones are plugged, removed ones unplugged). Runs for
/// the whole bed; acts only while the gate is on.
pub async fn run_declarative(ctx: Arc<HotplugCtx>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let vms: Api<VirtualMachine> = Api::all(ctx.client.clone());
    let stream = watcher(vms, watcher::Config::default()).applied_objects();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let vm = match event {
            Ok(vm) => vm,
            Err(e) => {
                tracing::debug!("sim declarative hot-plug: VM watch: {e}");
                continue;
            }
        };
        if !ctx.is_declarative() {
            continue;
        }
        if let Err(e) = sync_declarative(&ctx, &vm).await {
            tracing::warn!("sim declarative hot-plug of VM {:?}: {e}", vm.metadata.name);
        }
    }
}

async fn sync_declarative(ctx: &Arc<HotplugCtx>, vm: &VirtualMachine) -> Result<(), String> {
    let ns = vm.metadata.namespace.clone().unwrap_or_default();
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(vmi) = vmis.get_opt(&vm_name).await.map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let wanted = hotplugged(&vm.spec.template.spec);
    let present = hotplugged(&vmi.spec);
    for (volume, disk, claim, serial) in &wanted {
        if !present.iter().any(|p| p.0.name == volume.name) {
            ctx.record(SPEC_ADD, &ns, &vm_name, &volume.name);
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
            ctx.record(SPEC_REMOVE, &ns, &vm_name, &volume.name);
            unplug_from_vmi(ctx, &ns, &vm_name, &volume.name, claim, serial)
                .await
                .map_err(|_| format!("unplugging {} failed", volume.name))?;
        }
    }
    Ok(())
}
