//! KubeVirt's admission rules on the disks a hot-plug touches, as real validating webhooks of the
//! Harvester API server (one configuration `virt-api-validator`, as virt-operator names it,
//! kubevirt/kubevirt v1.7.0 `pkg/virt-operator/resource/generate/components/webhooks.go`):
//!
//! - `virtualmachine-validator.kubevirt.io` (VM CREATE, UPDATE; `VMsAdmitter.Admit`): the
//!   template's disks as `ValidateDisks` checks them (bus known, serial charset and length) and
//!   the hot-plug disk of each `status.volumeRequests` entry;
//! - `kubevirt-crd-status-validator.kubevirt.io` (`virtualmachines/status`; `AdmitStatus`): each
//!   `addVolumeOptions` of `status.volumeRequests` (`validateVolumeRequests`: the hot-plug disk
//!   configuration, then the template with the requests applied, through `ValidateDisks`) — where
//!   virt-api's `addvolume` under `HotplugVolumes` is refused;
//! - `virtualmachineinstances-update-validator.kubevirt.io` (VMI UPDATE; `admitHotplug` ->
//!   `AdmitHotplugStorage`): a hot-plugged volume new in the VMI spec needs a `scsi`/`virtio` disk
//!   (the sim is KubeVirt's service account: its VMI edits are hot-plugs).
//!
//! Sources: `pkg/storage/admitters/disks.go`, `storagehotplug.go` (v1.7.0, v1.8.3; in v1.6.0 the
//! same rules and texts in `pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go`,
//! `vmi-update-admitter.go`), `vms-admitter.go` `validateVolumeRequests` (v1.6.0-v1.8.3). A refusal
//! is `pkg/util/webhooks` `ToAdmissionResponse`: 422 `Invalid`, the causes' messages joined with
//! ", " (at most ten, then ", and N more validation errors"). Only these rules are played.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::webhook::{Refusal, Registration, Rule, Verdict, WebhookServer, handler};
use crate::BedError;
use crate::bed::certs::Pki;

pub const CONFIG_NAME: &str = "virt-api-validator";
pub const VM_WEBHOOK: &str = "virtualmachine-validator.kubevirt.io";
pub const STATUS_WEBHOOK: &str = "kubevirt-crd-status-validator.kubevirt.io";
pub const VMI_UPDATE_WEBHOOK: &str = "virtualmachineinstances-update-validator.kubevirt.io";
/// virt-api's paths (`webhooks.go` `VMValidatePath`, `StatusValidatePath`, `VMIUpdateValidatePath`).
pub const VM_PATH: &str = "/virtualmachines-validate";
pub const STATUS_PATH: &str = "/status-validate";
pub const VMI_UPDATE_PATH: &str = "/virtualmachineinstances-validate-update";

/// `maxStrLen` of `disks.go`.
const MAX_SERIAL: usize = 256;
/// The template disks' field path as `ValidateVirtualMachineSpec` builds it.
const TEMPLATE_DISKS: &str = "spec.template.spec.domain.devices.disks";
/// The field `validateVolumeRequests` names (`k8sfield.NewPath("Status", "volumeRequests")`).
const REQUESTS_FIELD: &str = "Status.volumeRequests";

/// One `metav1.StatusCause` of a refusal; every rule played is a `FieldValueInvalid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub message: String,
    /// The field path (`k8sfield.Path`), empty where upstream gives none.
    pub field: String,
}

impl Cause {
    fn new(message: String, field: impl Into<String>) -> Cause {
        Cause {
            message,
            field: field.into(),
        }
    }

    /// As Go marshals a `StatusCause`: the type under `reason`, an empty field left out.
    fn to_json(&self) -> Value {
        let mut c = json!({"reason": "FieldValueInvalid", "message": self.message});
        if !self.field.is_empty() {
            c["field"] = json!(self.field);
        }
        c
    }
}

/// Every refusal the webhooks gave, `(webhook path, message)`, in order.
#[derive(Clone, Default)]
pub struct Refusals(Arc<Mutex<Vec<(String, String)>>>);

impl Refusals {
    pub fn list(&self) -> Vec<(String, String)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn push(&self, path: &str, message: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((path.to_string(), message.to_string()));
    }
}

/// Routes the three webhooks on `server` and registers their configuration.
pub async fn install(
    server: &WebhookServer,
    client: &kube::Client,
    pki: &Pki,
) -> Result<Refusals, BedError> {
    let refusals = Refusals::default();
    for (path, check) in [
        (VM_PATH, vm_causes as fn(&Value) -> Vec<Cause>),
        (STATUS_PATH, status_causes),
        (VMI_UPDATE_PATH, vmi_update_causes),
    ] {
        let refusals = refusals.clone();
        server.route(
            path,
            handler(move |req| {
                let refusals = refusals.clone();
                async move {
                    let causes = check(&req);
                    if causes.is_empty() {
                        return Verdict::Allow;
                    }
                    let message = to_message(&causes);
                    refusals.push(path, &message);
                    Verdict::Refuse(
                        Refusal::invalid(message)
                            .with_causes(causes.iter().map(Cause::to_json).collect()),
                    )
                }
            }),
        );
    }
    let rule =
        |ops: &[&str], resource: &str| vec![Rule::new(ops, "kubevirt.io", "*", resource, "*")];
    let regs = [
        Registration::validating(
            CONFIG_NAME,
            VM_WEBHOOK,
            VM_PATH,
            rule(&["CREATE", "UPDATE"], "virtualmachines"),
        ),
        Registration::validating(
            CONFIG_NAME,
            STATUS_WEBHOOK,
            STATUS_PATH,
            rule(&["CREATE", "UPDATE"], "virtualmachines/status"),
        ),
        Registration::validating(
            CONFIG_NAME,
            VMI_UPDATE_WEBHOOK,
            VMI_UPDATE_PATH,
            rule(&["UPDATE"], "virtualmachineinstances"),
        ),
    ];
    // One configuration holding the three webhooks, as virt-operator installs it.
    let ca = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        &pki.lb_webhook_ca.cert_pem,
    );
    let mut object = regs[0].object(server.port, &ca);
    let webhooks: Vec<Value> = regs
        .iter()
        .filter_map(|r| r.object(server.port, &ca)["webhooks"].get(0).cloned())
        .collect();
    object["webhooks"] = Value::Array(webhooks);
    crate::bed::apply::apply_yaml(client, &object.to_string(), "default")
        .await
        .map(|_| ())?;
    Ok(refusals)
}

/// `ToAdmissionResponse`'s message.
fn to_message(causes: &[Cause]) -> String {
    let mut message = causes
        .iter()
        .take(10)
        .map(|c| c.message.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if causes.len() > 10 {
        message.push_str(&format!(
            ", and {} more validation errors",
            causes.len() - 10
        ));
    }
    message
}

fn disks_of(spec: &Value) -> Vec<Value> {
    spec.pointer("/domain/devices/disks")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The bus and device type of a disk (`getDiskBus`, `getDiskType`).
fn bus_and_type(disk: &Value) -> (String, &'static str) {
    for kind in ["disk", "lun", "cdrom"] {
        if let Some(d) = disk.get(kind).filter(|d| d.is_object()) {
            let bus = d.get("bus").and_then(Value::as_str).unwrap_or_default();
            return (bus.to_string(), kind);
        }
    }
    (String::new(), "")
}

fn serial_charset_ok(serial: &str) -> bool {
    serial
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-'))
}

/// `ValidateDisks`, the rules a hot-plugged disk can break: bus support, serial charset and
/// length.
pub fn validate_disks(field: &str, disks: &[Value]) -> Vec<Cause> {
    let mut causes = Vec::new();
    for (idx, disk) in disks.iter().enumerate() {
        let at = format!("{field}[{idx}]");
        let (bus, kind) = bus_and_type(disk);
        match bus.as_str() {
            "" | "scsi" | "usb" => {}
            "ide" => causes.push(Cause::new(
                "IDE bus is not supported".to_string(),
                format!("{at}.{kind}.bus"),
            )),
            "virtio" if kind == "cdrom" => causes.push(Cause::new(
                format!("Bus type {bus} is invalid for CD-ROM device"),
                format!("{at}.cdrom.bus"),
            )),
            "virtio" => {}
            "sata" => {
                if kind == "disk"
                    && disk.pointer("/disk/readonly").and_then(Value::as_bool) == Some(true)
                {
                    causes.push(Cause::new(
                        format!("{bus} hard-disks do not support read-only."),
                        format!("{at}.disk.bus"),
                    ));
                }
            }
            other => causes.push(Cause::new(
                format!(
                    "{at} is set with an unrecognized bus {other}, must be one of: [virtio scsi sata usb]"
                ),
                format!("{at}.{kind}.bus"),
            )),
        }
        if let Some(serial) = disk.get("serial").and_then(Value::as_str)
            && !serial.is_empty()
        {
            if !serial_charset_ok(serial) {
                causes.push(Cause::new(
                    format!(
                        "{at} must be made up of the following characters [A-Za-z0-9_.+-], if specified"
                    ),
                    format!("{at}.serial"),
                ));
            }
            if serial.chars().count() > MAX_SERIAL {
                causes.push(Cause::new(
                    format!(
                        "{at} must be less than or equal to {MAX_SERIAL} in length, if specified"
                    ),
                    format!("{at}.serial"),
                ));
            }
        }
    }
    causes
}

/// `ValidateHotplugDiskConfiguration`: the first cause only, as upstream returns.
pub fn hotplug_disk_cause(
    disk: Option<&Value>,
    name: &str,
    prefix: &str,
    field: &str,
) -> Option<Cause> {
    hotplug_disk_text(disk, name, prefix).map(|m| Cause::new(m, field))
}

fn hotplug_disk_text(disk: Option<&Value>, name: &str, prefix: &str) -> Option<String> {
    let Some(disk) = disk.filter(|d| d.is_object()) else {
        return Some(format!(
            "{prefix} for [{name}] requires the disk field to be set."
        ));
    };
    let (bus, kind) = bus_and_type(disk);
    match kind {
        "disk" if bus != "scsi" && bus != "virtio" => Some(format!(
            "{prefix} for disk [{name}] requires bus to be 'scsi' or 'virtio'. [{bus}] is not permitted."
        )),
        "lun" if bus != "scsi" => Some(format!(
            "{prefix} for LUN [{name}] requires bus to be 'scsi'. [{bus}] is not permitted."
        )),
        "disk" | "lun" => None,
        _ => Some(format!(
            "{prefix} for [{name}] requires diskDevice of type 'disk' or 'lun' to be used."
        )),
    }
}

/// `validateVolumeRequests`: each add request's disk, then the template with the requests
/// applied (`ApplyVolumeRequestOnVMISpec`: an added disk goes last) through `ValidateDisks`.
fn volume_request_causes(vm: &Value) -> Vec<Cause> {
    let Some(requests) = vm
        .pointer("/status/volumeRequests")
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
    else {
        return Vec::new();
    };
    let mut disks = disks_of(vm.pointer("/spec/template/spec").unwrap_or(&Value::Null));
    for r in requests {
        if let Some(add) = r.get("addVolumeOptions") {
            let name = add.get("name").and_then(Value::as_str).unwrap_or_default();
            if let Some(cause) =
                hotplug_disk_cause(add.get("disk"), name, "AddVolume request", REQUESTS_FIELD)
            {
                return vec![cause];
            }
            if !disks
                .iter()
                .any(|d| d.get("name").and_then(Value::as_str) == Some(name))
            {
                let mut disk = add.get("disk").cloned().unwrap_or_else(|| json!({}));
                disk["name"] = json!(name);
                disks.push(disk);
            }
        } else if let Some(name) = r
            .pointer("/removeVolumeOptions/name")
            .and_then(Value::as_str)
        {
            disks.retain(|d| d.get("name").and_then(Value::as_str) != Some(name));
        }
    }
    validate_disks(TEMPLATE_DISKS, &disks)
}

fn object(req: &Value) -> &Value {
    req.get("object").unwrap_or(&Value::Null)
}

/// `VMsAdmitter.Admit` (for the rules played): a VM being deleted passes; the template's disks,
/// then its volume requests.
fn vm_causes(req: &Value) -> Vec<Cause> {
    let vm = object(req);
    if vm
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
    {
        return Vec::new();
    }
    let causes = validate_disks(
        TEMPLATE_DISKS,
        &disks_of(vm.pointer("/spec/template/spec").unwrap_or(&Value::Null)),
    );
    if !causes.is_empty() {
        return causes;
    }
    volume_request_causes(vm)
}

/// `VMsAdmitter.AdmitStatus` (for the rules played).
fn status_causes(req: &Value) -> Vec<Cause> {
    volume_request_causes(object(req))
}

/// `AdmitHotplugStorage` for hot-plugged disks: a hot-pluggable volume new in the VMI spec whose
/// disk is new too must pass `ValidateHotplugDiskConfiguration` ("Hotplug configuration").
fn vmi_update_causes(req: &Value) -> Vec<Cause> {
    let new = object(req);
    let old = req.get("oldObject").unwrap_or(&Value::Null);
    let volumes = |vmi: &Value| -> Vec<Value> {
        vmi.pointer("/spec/volumes")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let name_of = |v: &Value| {
        v.get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let old_volumes: Vec<String> = volumes(old).iter().map(name_of).collect();
    let old_disks: Vec<String> = disks_of(old.get("spec").unwrap_or(&Value::Null))
        .iter()
        .map(name_of)
        .collect();
    let new_disks = disks_of(new.get("spec").unwrap_or(&Value::Null));
    for v in volumes(new) {
        let name = name_of(&v);
        let hotplug = v
            .pointer("/persistentVolumeClaim/hotpluggable")
            .and_then(Value::as_bool)
            == Some(true)
            || v.pointer("/dataVolume/hotpluggable")
                .and_then(Value::as_bool)
                == Some(true);
        if !hotplug || old_volumes.contains(&name) || old_disks.contains(&name) {
            continue;
        }
        let Some(disk) = new_disks.iter().find(|d| name_of(d) == name) else {
            return vec![Cause::new(format!("disk {name} does not exist"), "")];
        };
        if let Some(cause) = hotplug_disk_cause(Some(disk), &name, "Hotplug configuration", "") {
            return vec![cause];
        }
    }
    Vec::new()
}

/// Waits until the Harvester API server calls the VM webhook: a dry-run VM with a disk serial
/// KubeVirt refuses comes back refused by it.
pub async fn wait_called(client: &kube::Client, namespace: &str) -> Result<(), BedError> {
    use harvester_common::harvester::VirtualMachine;
    let api: kube::Api<VirtualMachine> = kube::Api::namespaced(client.clone(), namespace);
    let probe: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "testbed-kubevirt-validator-probe"},
        "spec": {"running": false, "template": {"spec": {"domain": {"devices": {
            "disks": [{"name": "probe", "serial": "not/valid", "disk": {"bus": "scsi"}}]}}}}}
    }))
    .map_err(|e| BedError::Setup(format!("KubeVirt validator probe: {e}")))?;
    super::webhook::wait_refused(
        api,
        probe,
        VM_WEBHOOK,
        "the Harvester API server calls KubeVirt's VM validator",
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_rules_read_like_upstream() {
        let disks = [
            json!({"name": "ok", "serial": "pvc-1_a.b+c", "disk": {"bus": "scsi"}}),
            json!({"name": "slash", "serial": "a/b", "disk": {"bus": "scsi"}}),
            json!({"name": "long", "serial": "x".repeat(257), "disk": {"bus": "virtio"}}),
            json!({"name": "odd", "disk": {"bus": "floppy"}}),
            json!({"name": "sata", "disk": {"bus": "sata"}}),
        ];
        let messages = |c: Vec<Cause>| c.into_iter().map(|c| c.message).collect::<Vec<_>>();
        let causes = validate_disks("f", &disks);
        assert_eq!(causes[0].field, "f[1].serial");
        assert_eq!(causes[2].field, "f[3].disk.bus");
        assert_eq!(
            messages(causes),
            [
                "f[1] must be made up of the following characters [A-Za-z0-9_.+-], if specified",
                "f[2] must be less than or equal to 256 in length, if specified",
                "f[3] is set with an unrecognized bus floppy, must be one of: [virtio scsi sata usb]",
            ]
        );
        assert_eq!(hotplug_disk_text(Some(&disks[0]), "ok", "P"), None);
        assert_eq!(
            hotplug_disk_text(Some(&disks[4]), "sata", "AddVolume request").as_deref(),
            Some(
                "AddVolume request for disk [sata] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted."
            )
        );
        assert_eq!(
            hotplug_disk_text(None, "x", "P").as_deref(),
            Some("P for [x] requires the disk field to be set.")
        );
        assert_eq!(
            hotplug_disk_text(Some(&json!({"cdrom": {"bus": "sata"}})), "c", "P").as_deref(),
            Some("P for [c] requires diskDevice of type 'disk' or 'lun' to be used.")
        );
        let many: Vec<Cause> = (0..12).map(|i| Cause::new(i.to_string(), "")).collect();
        assert_eq!(
            to_message(&many),
            "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, and 2 more validation errors"
        );
    }

    #[test]
    fn a_status_request_is_checked_then_applied_to_the_template() {
        let vm = |disk: Value| {
            json!({"spec": {"template": {"spec": {"domain": {"devices": {"disks": [
                       {"name": "root", "disk": {"bus": "virtio"}}]}}}}},
                   "status": {"volumeRequests": [{"addVolumeOptions": {"name": "v", "disk": disk}}]}})
        };
        let messages = |c: Vec<Cause>| c.into_iter().map(|c| c.message).collect::<Vec<_>>();
        assert_eq!(
            messages(volume_request_causes(&vm(
                json!({"serial": "a/b", "disk": {"bus": "scsi"}})
            ))),
            [format!(
                "{TEMPLATE_DISKS}[1] must be made up of the following characters [A-Za-z0-9_.+-], if specified"
            )]
        );
        let bus = volume_request_causes(&vm(json!({"serial": "ok", "disk": {"bus": "sata"}})));
        assert_eq!(bus[0].field, REQUESTS_FIELD);
        assert_eq!(
            messages(bus),
            [
                "AddVolume request for disk [v] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted."
            ]
        );
        assert!(
            volume_request_causes(&vm(json!({"serial": "ok", "disk": {"bus": "scsi"}}))).is_empty()
        );
        // Bad input never panics.
        assert!(vm_causes(&json!(null)).is_empty());
        assert!(vmi_update_causes(&json!({"object": 3})).is_empty());
    }
}
