//! Pure decisions of the service controller: the LoadBalancer CR a Service needs, the changes
//! to the guest Service once an address is known, and ([`ServiceProblem`]) what is wrong with a
//! Service and the Event reason of each. No client, no clock.

use std::collections::BTreeMap;

use harvester_common::harvester::LoadBalancer;
use harvester_common::harvester::loadbalancer::{
    ANN_CLUSTER, ANN_NAMESPACE, ANN_NETWORK, ANN_PROJECT, LoadBalancerSpec,
};
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;

use super::annotations::{
    KUBE_VIP_INTERFACE, KUBE_VIP_IPS, LABEL_PRIMARY_SERVICE, PortKey, ServiceKey, ServiceLbSpec,
};
use super::name::lb_name;

mod problem;
pub use problem::*;

pub const LABEL_CLUSTER: &str = "cloudprovider.harvesterhci.io/cluster";
pub const LABEL_SERVICE_NAMESPACE: &str = "cloudprovider.harvesterhci.io/serviceNamespace";
pub const LABEL_SERVICE_NAME: &str = "cloudprovider.harvesterhci.io/serviceName";
/// The network the CR was created with; the network is immutable afterwards.
pub const ANN_LB_NETWORK: &str = "cloudprovider.harvesterhci.io/lb-network";
pub const ANN_MANAGEMENT_NETWORK: &str = "cloudprovider.harvesterhci.io/managementNetwork";

/// CR annotations Harvester's LoadBalancer mutating webhook rewrites on every create and update
/// of a cluster LoadBalancer (harvester/load-balancer-harvester
/// `pkg/webhook/loadbalancer/mutator.go`, v1.7.0 to v1.9.0-rc4): the namespace (= the CR's
/// own), the project (= its Namespace's `field.cattle.io/projectId`) and the network (v1.9 keeps
/// a value already there; v1.7-v1.8 re-derive it from the guest cluster's VMIs). We send the
/// first two on create from the Service, as the upstream provider does, but never plan drift on
/// any of them: a write of ours would be reverted, storing nothing.
pub const WEBHOOK_OWNED: [&str; 3] = [ANN_NAMESPACE, ANN_PROJECT, ANN_NETWORK];

/// Settings of the service controller that shape the CR.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbSettings {
    pub cluster_name: String,
    /// `--management-network`, normalised to `ns/name`.
    pub management_network: Option<String>,
    /// `--load-balancer-class`: serve Services of this class (and those without one).
    pub load_balancer_class: Option<String>,
    /// `--dhcp-mode`: who leases `ipam: dhcp` addresses.
    pub dhcp_mode: super::dhcp::DhcpMode,
    /// `--dhcp-interface`: where to lease when the Service's network maps to no interface
    /// (without it, the default route's interface).
    pub dhcp_interface: Option<String>,
    /// `--concurrent-service-syncs`: at most this many reconciles at once; `None`: unbounded.
    pub concurrency: Option<u16>,
    /// `--default-ipam`: the address source of a Service without an `ipam` annotation.
    pub default_ipam: super::annotations::Ipam,
}

impl LbSettings {
    /// The service controller's flags.
    pub fn from_config(config: &crate::config::Config) -> LbSettings {
        LbSettings {
            cluster_name: config.cluster_name.clone(),
            management_network: config.management_network.as_ref().map(ToString::to_string),
            load_balancer_class: config.service.load_balancer_class.clone(),
            dhcp_mode: config.service.dhcp_mode.clone(),
            dhcp_interface: config.service.dhcp_interface.clone(),
            concurrency: config.service.concurrency,
            default_ipam: config.service.default_ipam,
        }
    }
}

/// Whether this controller serves the Service.
pub fn wants_load_balancer(svc: &Service, settings: &LbSettings) -> bool {
    let Some(spec) = svc.spec.as_ref() else {
        return false;
    };
    spec.type_.as_deref() == Some("LoadBalancer")
        && match spec.load_balancer_class.as_deref() {
            None => true,
            Some(class) => settings.load_balancer_class.as_deref() == Some(class),
        }
}

/// The CR name of a Service (upstream algorithm).
pub fn cr_name(svc: &Service, settings: &LbSettings) -> String {
    lb_name(
        &settings.cluster_name,
        &svc.namespace().unwrap_or_default(),
        &svc.name_any(),
        svc.uid().as_deref().unwrap_or_default(),
    )
}

/// The LoadBalancer CR a primary Service needs: wire-compatible with the upstream provider.
pub fn desired_lb(
    svc: &Service,
    spec: &ServiceLbSpec,
    settings: &LbSettings,
    namespace: &str,
) -> LoadBalancer {
    let key = ServiceKey::of(svc);
    let labels = BTreeMap::from([
        (LABEL_CLUSTER.to_string(), settings.cluster_name.clone()),
        (LABEL_SERVICE_NAMESPACE.to_string(), key.namespace.clone()),
        (LABEL_SERVICE_NAME.to_string(), key.name.clone()),
    ]);
    let mut annotations =
        BTreeMap::from([(ANN_CLUSTER.to_string(), settings.cluster_name.clone())]);
    if let Some(n) = &spec.network {
        annotations.insert(ANN_NETWORK.into(), n.clone());
        annotations.insert(ANN_LB_NETWORK.into(), n.clone());
    }
    if let Some(p) = &spec.project {
        annotations.insert(ANN_PROJECT.into(), p.clone());
    }
    if let Some(n) = &spec.namespace {
        annotations.insert(ANN_NAMESPACE.into(), n.clone());
    }
    if let Some(m) = &settings.management_network {
        annotations.insert(ANN_MANAGEMENT_NETWORK.into(), m.clone());
    }
    let mut lb = LoadBalancer::new(
        &cr_name(svc, settings),
        LoadBalancerSpec {
            workload_type: Some("cluster".into()),
            ipam: Some(spec.ipam.as_str().into()),
            ..Default::default()
        },
    );
    lb.metadata.namespace = Some(namespace.to_string());
    lb.metadata.labels = Some(labels);
    lb.metadata.annotations = Some(annotations);
    lb
}

/// What to change on an existing CR so it matches `desired`. The network annotations are
/// immutable, and `ipam` cannot switch (Harvester's webhook refuses it): both are reported, not
/// changed. The keys Harvester's webhook owns ([`WEBHOOK_OWNED`]) are never drift.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrDrift {
    /// Labels and annotations to set (a merge patch of metadata).
    pub metadata: BTreeMap<String, BTreeMap<String, Option<String>>>,
    /// The Service asks for another network than the CR was created with.
    pub network_changed: Option<(Option<String>, Option<String>)>,
    /// The Service asks for another ipam mode than the CR has.
    pub ipam_changed: Option<(Option<String>, Option<String>)>,
}

pub fn cr_drift(existing: &LoadBalancer, desired: &LoadBalancer) -> CrDrift {
    let mut drift = CrDrift::default();
    let old_net = existing.annotations().get(ANN_LB_NETWORK).cloned();
    let new_net = desired.annotations().get(ANN_LB_NETWORK).cloned();
    if old_net != new_net {
        drift.network_changed = Some((old_net, new_net));
    }
    if existing.spec.ipam != desired.spec.ipam {
        drift.ipam_changed = Some((existing.spec.ipam.clone(), desired.spec.ipam.clone()));
    }
    let mut labels = BTreeMap::new();
    for (k, v) in desired.labels() {
        if existing.labels().get(k) != Some(v) {
            labels.insert(k.clone(), Some(v.clone()));
        }
    }
    let mut annotations = BTreeMap::new();
    for (k, v) in desired.annotations() {
        if k == ANN_LB_NETWORK || WEBHOOK_OWNED.contains(&k.as_str()) {
            continue;
        }
        if existing.annotations().get(k) != Some(v) {
            annotations.insert(k.clone(), Some(v.clone()));
        }
    }
    // --management-network unset: the annotation goes (as upstream).
    if desired.annotations().get(ANN_MANAGEMENT_NETWORK).is_none()
        && existing.annotations().contains_key(ANN_MANAGEMENT_NETWORK)
    {
        annotations.insert(ANN_MANAGEMENT_NETWORK.into(), None);
    }
    if !labels.is_empty() {
        drift.metadata.insert("labels".into(), labels);
    }
    if !annotations.is_empty() {
        drift.metadata.insert("annotations".into(), annotations);
    }
    drift
}

/// Applies [`CrDrift::metadata`] (labels/annotations to set or remove) to a CR.
pub fn apply_metadata(
    cr: &mut LoadBalancer,
    metadata: &BTreeMap<String, BTreeMap<String, Option<String>>>,
) {
    for (part, changes) in metadata {
        let target = match part.as_str() {
            "labels" => cr.metadata.labels.get_or_insert_with(Default::default),
            _ => cr.metadata.annotations.get_or_insert_with(Default::default),
        };
        for (k, v) in changes {
            match v {
                Some(v) => target.insert(k.clone(), v.clone()),
                None => target.remove(k),
            };
        }
    }
}

/// Changes to a guest Service that has an address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceChange {
    /// Annotations to set (`Some`) or remove (`None`).
    pub annotations: BTreeMap<String, Option<String>>,
    /// Labels to set or remove.
    pub labels: BTreeMap<String, Option<String>>,
    /// The new `status.loadBalancer.ingress` IPs, when they differ.
    pub ingress: Option<Vec<String>>,
}

impl ServiceChange {
    pub fn is_empty(&self) -> bool {
        self.annotations.is_empty() && self.labels.is_empty() && self.ingress.is_none()
    }
}

fn set_if_differs(
    out: &mut BTreeMap<String, Option<String>>,
    current: &BTreeMap<String, String>,
    key: &str,
    want: Option<&str>,
) {
    if current.get(key).map(String::as_str) != want {
        out.insert(key.into(), want.map(str::to_string));
    }
}

/// The JSON merge patch of a [`ServiceChange`]: exactly the annotations and labels we own
/// (`null` removes one) and, when it changes, the whole ingress list. `None`: nothing to write.
pub fn change_patch(change: &ServiceChange) -> Option<serde_json::Value> {
    if change.is_empty() {
        return None;
    }
    let mut body = serde_json::Map::new();
    let mut metadata = serde_json::Map::new();
    if !change.annotations.is_empty() {
        metadata.insert("annotations".into(), serde_json::json!(change.annotations));
    }
    if !change.labels.is_empty() {
        metadata.insert("labels".into(), serde_json::json!(change.labels));
    }
    if !metadata.is_empty() {
        body.insert("metadata".into(), metadata.into());
    }
    if let Some(ips) = &change.ingress {
        let ingress: Vec<_> = ips
            .iter()
            .map(|ip| serde_json::json!({"ip": ip, "ipMode": "VIP"}))
            .collect();
        body.insert(
            "status".into(),
            serde_json::json!({"loadBalancer": {"ingress": ingress}}),
        );
    }
    Some(body.into())
}

/// The Service's first load-balancer ingress address, if it has one.
pub fn ingress_ip(svc: &Service) -> Option<String> {
    ingress_ips(svc).into_iter().next()
}

pub fn ingress_ips(svc: &Service) -> Vec<String> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ing| ing.iter().filter_map(|i| i.ip.clone()).collect())
        .unwrap_or_default()
}

/// A primary with address `ip` (and kube-vip interface `iface` when a network maps to one).
pub fn primary_change(svc: &Service, ip: &str, iface: Option<&str>) -> ServiceChange {
    addressed_change(svc, ip, iface, None)
}

/// A secondary following `primary` at address `ip`.
pub fn secondary_change(svc: &Service, primary: &ServiceKey, ip: &str) -> ServiceChange {
    addressed_change(svc, ip, None, Some(&primary.label_value()))
}

/// A Service at address `ip`: kube-vip's annotations, the primary-service label (secondaries
/// only) and the ingress, each written only when it differs.
fn addressed_change(
    svc: &Service,
    ip: &str,
    iface: Option<&str>,
    primary_label: Option<&str>,
) -> ServiceChange {
    let mut change = ServiceChange::default();
    set_if_differs(
        &mut change.annotations,
        svc.annotations(),
        KUBE_VIP_IPS,
        Some(ip),
    );
    set_if_differs(
        &mut change.annotations,
        svc.annotations(),
        KUBE_VIP_INTERFACE,
        iface,
    );
    set_if_differs(
        &mut change.labels,
        svc.labels(),
        LABEL_PRIMARY_SERVICE,
        primary_label,
    );
    if ingress_ips(svc) != [ip] {
        change.ingress = Some(vec![ip.to_string()]);
    }
    change
}

/// `--dhcp-mode=kube-vip`: the Service's requested IPv4 address handed to kube-vip's DHCP client
/// as `kube-vip.io/requestedIP` (which it sends as option 50: kube-vip v1.2.3
/// `pkg/instance/instance.go` reads the annotation, `pkg/vip/dhcpv4.go` requests it), unless the
/// Service already has one (kube-vip's record of its lease).
pub fn kube_vip_dhcp_request(svc: &Service, spec: &ServiceLbSpec) -> Option<(String, String)> {
    let std::net::IpAddr::V4(wanted) = spec.requested()? else {
        return None;
    };
    let key = super::dhcp::KUBE_VIP_REQUESTED_IP;
    (!svc.annotations().contains_key(key)).then(|| (key.to_string(), wanted.to_string()))
}

/// What a Service that no longer has a load balancer keeps of ours: nothing.
pub fn released_change(svc: &Service) -> ServiceChange {
    let mut change = ServiceChange::default();
    for key in [KUBE_VIP_IPS, KUBE_VIP_INTERFACE] {
        set_if_differs(&mut change.annotations, svc.annotations(), key, None);
    }
    set_if_differs(
        &mut change.labels,
        svc.labels(),
        LABEL_PRIMARY_SERVICE,
        None,
    );
    if !ingress_ips(svc).is_empty() {
        change.ingress = Some(vec![]);
    }
    change
}

/// Ports used by both sides (port number and protocol).
pub fn overlapping_ports(a: &[PortKey], b: &[PortKey]) -> Vec<PortKey> {
    a.iter().filter(|p| b.contains(p)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::annotations::Ipam;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    fn web() -> Service {
        svc(json!({
            "metadata": {"name": "web", "namespace": "apps", "uid": "u-1",
                         "annotations": {"cloudprovider.harvesterhci.io/network": "default/vlan10"}},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
        }))
    }

    fn settings() -> LbSettings {
        LbSettings {
            cluster_name: "rke2".into(),
            management_network: Some("default/mgmt".into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_change_is_one_merge_patch_of_exactly_our_fields() {
        assert_eq!(change_patch(&ServiceChange::default()), None);
        let first = primary_change(&web(), "10.0.0.7", Some("eth1"));
        assert_eq!(
            change_patch(&first),
            Some(json!({
                "metadata": {"annotations": {KUBE_VIP_IPS: "10.0.0.7", KUBE_VIP_INTERFACE: "eth1"}},
                "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.7", "ipMode": "VIP"}]}}
            }))
        );
        let mut addressed = web();
        addressed
            .annotations_mut()
            .insert(KUBE_VIP_IPS.into(), "10.0.0.7".into());
        let released = released_change(&addressed);
        assert_eq!(
            change_patch(&released),
            Some(json!({"metadata": {"annotations": {KUBE_VIP_IPS: null}}})),
            "no ingress to clear: metadata only, and a removal is a null"
        );
    }

    #[test]
    fn desired_lb_matches_the_upstream_shape() {
        let s = web();
        let spec = ServiceLbSpec::from_service(&s).unwrap();
        let lb = desired_lb(&s, &spec, &settings(), "guest-vms");
        assert_eq!(
            lb.metadata.name.as_deref(),
            Some(&*lb_name("rke2", "apps", "web", "u-1"))
        );
        assert_eq!(lb.metadata.namespace.as_deref(), Some("guest-vms"));
        assert_eq!(lb.spec.workload_type.as_deref(), Some("cluster"));
        assert_eq!(lb.spec.ipam.as_deref(), Some("pool"));
        assert_eq!(lb.spec.ip_pool, None);
        let l = lb.labels();
        assert_eq!(l.get(LABEL_CLUSTER).map(String::as_str), Some("rke2"));
        assert_eq!(
            l.get(LABEL_SERVICE_NAMESPACE).map(String::as_str),
            Some("apps")
        );
        assert_eq!(l.get(LABEL_SERVICE_NAME).map(String::as_str), Some("web"));
        let a = lb.annotations();
        assert_eq!(
            a.get(ANN_NETWORK).map(String::as_str),
            Some("default/vlan10")
        );
        assert_eq!(
            a.get(ANN_LB_NETWORK).map(String::as_str),
            Some("default/vlan10")
        );
        assert_eq!(a.get(ANN_CLUSTER).map(String::as_str), Some("rke2"));
        assert_eq!(
            a.get(ANN_MANAGEMENT_NETWORK).map(String::as_str),
            Some("default/mgmt")
        );
        assert_eq!(spec.ipam, Ipam::Pool);
    }

    #[test]
    fn load_balancer_class_selects_services() {
        let mut s = web();
        assert!(wants_load_balancer(&s, &settings()));
        s.spec.as_mut().unwrap().load_balancer_class = Some("other.io/lb".into());
        assert!(!wants_load_balancer(&s, &settings()));
        let mine = LbSettings {
            load_balancer_class: Some("other.io/lb".into()),
            ..settings()
        };
        assert!(wants_load_balancer(&s, &mine));
        s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        assert!(!wants_load_balancer(&s, &mine));
    }

    #[test]
    fn network_and_ipam_changes_are_reported_not_applied() {
        let s = web();
        let spec = ServiceLbSpec::from_service(&s).unwrap();
        let existing = desired_lb(&s, &spec, &settings(), "ns");
        let mut changed = s.clone();
        changed.metadata.annotations = Some(BTreeMap::from([
            (
                "cloudprovider.harvesterhci.io/network".to_string(),
                "default/vlan20".to_string(),
            ),
            (
                "cloudprovider.harvesterhci.io/ipam".to_string(),
                "dhcp".to_string(),
            ),
        ]));
        let spec2 = ServiceLbSpec::from_service(&changed).unwrap();
        let drift = cr_drift(&existing, &desired_lb(&changed, &spec2, &settings(), "ns"));
        assert_eq!(
            drift.network_changed,
            Some((Some("default/vlan10".into()), Some("default/vlan20".into())))
        );
        assert_eq!(
            drift.ipam_changed,
            Some((Some("pool".into()), Some("dhcp".into())))
        );
        assert!(drift.metadata.is_empty(), "{drift:?}");
    }

    #[test]
    fn drift_applied_leaves_no_drift() {
        let s = web();
        let spec = ServiceLbSpec::from_service(&s).unwrap();
        let mut existing = desired_lb(&s, &spec, &settings(), "ns");
        existing
            .labels_mut()
            .insert(LABEL_CLUSTER.into(), "old-name".into());
        let none = LbSettings {
            management_network: None,
            ..settings()
        };
        let desired = desired_lb(&s, &spec, &none, "ns");
        let drift = cr_drift(&existing, &desired);
        assert!(!drift.metadata.is_empty());
        apply_metadata(&mut existing, &drift.metadata);
        assert_eq!(cr_drift(&existing, &desired), CrDrift::default());
    }

    #[test]
    fn keys_harvesters_webhook_owns_are_sent_on_create_and_never_drift() {
        let mut s = web();
        s.annotations_mut().extend([
            (
                super::super::annotations::ANN_PROJECT.to_string(),
                "c-1/p-1".to_string(),
            ),
            (
                super::super::annotations::ANN_NAMESPACE.to_string(),
                "apps".to_string(),
            ),
        ]);
        let spec = ServiceLbSpec::from_service(&s).unwrap();
        let desired = desired_lb(&s, &spec, &settings(), "guest-vms");
        // On create, as the upstream provider sends them (the webhook rewrites them there too).
        assert_eq!(desired.annotations()[ANN_PROJECT], "c-1/p-1");
        assert_eq!(desired.annotations()[ANN_NAMESPACE], "apps");
        // The CR as Harvester's webhook left it: its own namespace, its Namespace's project,
        // another network.
        let mut existing = desired.clone();
        existing.annotations_mut().extend([
            (ANN_NAMESPACE.to_string(), "guest-vms".to_string()),
            (ANN_PROJECT.to_string(), String::new()),
            (ANN_NETWORK.to_string(), "default/derived".to_string()),
        ]);
        assert_eq!(cr_drift(&existing, &desired), CrDrift::default());
        // Removed by the webhook (or never there): still no drift.
        for k in WEBHOOK_OWNED {
            existing.annotations_mut().remove(k);
        }
        assert_eq!(cr_drift(&existing, &desired), CrDrift::default());
        // A key the webhook does not own still drifts.
        existing
            .annotations_mut()
            .insert(ANN_CLUSTER.into(), "old".into());
        assert_eq!(
            cr_drift(&existing, &desired).metadata["annotations"].get(ANN_CLUSTER),
            Some(&Some("rke2".to_string()))
        );
    }

    #[test]
    fn unsetting_the_management_network_removes_its_annotation() {
        let s = web();
        let spec = ServiceLbSpec::from_service(&s).unwrap();
        let existing = desired_lb(&s, &spec, &settings(), "ns");
        let none = LbSettings {
            management_network: None,
            ..settings()
        };
        let drift = cr_drift(&existing, &desired_lb(&s, &spec, &none, "ns"));
        assert_eq!(
            drift.metadata["annotations"].get(ANN_MANAGEMENT_NETWORK),
            Some(&None)
        );
    }

    #[test]
    fn primary_change_is_empty_once_applied() {
        let mut s = web();
        let c = primary_change(&s, "10.0.0.5", Some("eth1"));
        assert_eq!(
            c.annotations.get(KUBE_VIP_IPS),
            Some(&Some("10.0.0.5".into()))
        );
        assert_eq!(
            c.annotations.get(KUBE_VIP_INTERFACE),
            Some(&Some("eth1".into()))
        );
        assert_eq!(c.ingress, Some(vec!["10.0.0.5".to_string()]));
        s.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .extend([
                (KUBE_VIP_IPS.to_string(), "10.0.0.5".to_string()),
                (KUBE_VIP_INTERFACE.to_string(), "eth1".to_string()),
            ]);
        s.status = Some(
            serde_json::from_value(json!({"loadBalancer": {"ingress": [{"ip": "10.0.0.5"}]}}))
                .unwrap(),
        );
        assert!(primary_change(&s, "10.0.0.5", Some("eth1")).is_empty());
    }

    #[test]
    fn secondary_follows_the_primary_and_drops_the_interface() {
        let mut s = web();
        s.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(KUBE_VIP_INTERFACE.into(), "eth1".into());
        let primary = ServiceKey {
            namespace: "apps".into(),
            name: "gw".into(),
        };
        let c = secondary_change(&s, &primary, "10.0.0.5");
        assert_eq!(
            c.labels.get(LABEL_PRIMARY_SERVICE),
            Some(&Some("apps.gw".into()))
        );
        assert_eq!(c.annotations.get(KUBE_VIP_INTERFACE), Some(&None));
        assert_eq!(
            c.annotations.get(KUBE_VIP_IPS),
            Some(&Some("10.0.0.5".into()))
        );
    }

    #[test]
    fn kube_vip_dhcp_gets_the_requested_ipv4_address_unless_it_holds_one() {
        let asking = |lb_ip: &str, ann: serde_json::Value| {
            let s = svc(json!({
                "metadata": {"name": "dns", "namespace": "apps", "annotations": ann},
                "spec": {"type": "LoadBalancer", "loadBalancerIP": lb_ip}
            }));
            let spec = ServiceLbSpec::from_service(&s).unwrap();
            kube_vip_dhcp_request(&s, &spec)
        };
        assert_eq!(
            asking("10.0.0.9", json!({})),
            Some(("kube-vip.io/requestedIP".into(), "10.0.0.9".into()))
        );
        assert_eq!(asking("fd00::9", json!({})), None, "DHCPv4 only");
        assert_eq!(asking("", json!({})), None);
        assert_eq!(
            asking("10.0.0.9", json!({"kube-vip.io/requestedIP": "10.0.0.3"})),
            None,
            "kube-vip's lease is kept"
        );
    }

    #[test]
    fn ports_overlap_by_port_and_protocol() {
        let p = |port, proto: &str| PortKey {
            port,
            protocol: proto.into(),
        };
        assert_eq!(
            overlapping_ports(&[p(53, "UDP"), p(80, "TCP")], &[p(53, "TCP"), p(80, "TCP")]),
            vec![p(80, "TCP")]
        );
        assert!(overlapping_ports(&[p(53, "UDP")], &[p(53, "TCP")]).is_empty());
    }
}
