//! The cloud-config rotated as docs/security.md says, on the real guest cluster: a new token
//! written into the Secret, the old one revoked once both programs use the new file. Nothing
//! restarts, and both programs keep acting on Harvester with the new token.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::bed::guest_cluster::{self, CLOUD_CONFIG_SECRET, GuestCluster, NAMESPACE};
use testbed::real::pod_logs::LogWatch;
use testbed::{TestBed, util::wait};

/// What each program logs when it switched to a changed cloud-config
/// (harvester_common::cloud_config `follow_file`).
const SWITCHED: &str = "the Harvester client now uses it";
/// The kubelet's update of a Secret volume (its sync period, up to a minute, plus the cache) and
/// the programs' 10 s re-read (docs/operations.md).
const ROTATION_BOUND: Duration = Duration::from_secs(150);
const ACCOUNT: &str = "rotation";

/// The chart Pods that hold the cloud-config: name -> (uid, restarts).
async fn holders(bed: &TestBed) -> BTreeMap<String, (String, i32)> {
    let pods = Api::<Pod>::namespaced(bed.guest.client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .expect("list kube-system Pods");
    pods.items
        .iter()
        .filter(|p| {
            let name = p.name_any();
            name.starts_with("harvester-cloud-provider-")
                || name.starts_with("harvester-csi-driver-controllers-")
        })
        .map(|p| {
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map_or(0, |c| c.iter().map(|c| c.restart_count).sum());
            (p.name_any(), (p.uid().unwrap_or_default(), restarts))
        })
        .collect()
}

/// A token of the Harvester account bound to the Secret `name` of the VM namespace: deleting
/// that Secret revokes it.
async fn bound_token(bed: &TestBed, name: &str) -> String {
    let ns = &bed.vm_namespace;
    let secrets: Api<Secret> = Api::namespaced(bed.harvester.client.clone(), ns);
    let anchor = secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).expect("Secret"),
        )
        .await
        .unwrap_or_else(|e| panic!("Secret {ns}/{name}: {e}"));
    let request = serde_json::from_value(json!({
        "spec": {"expirationSeconds": 3600, "boundObjectRef": {
            "apiVersion": "v1", "kind": "Secret", "name": name, "uid": anchor.uid()}}
    }))
    .expect("TokenRequest");
    Api::<ServiceAccount>::namespaced(bed.harvester.client.clone(), ns)
        .create_token_request(ACCOUNT, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {ns}/{ACCOUNT}: {e}"))
        .status
        .map(|s| s.token)
        .expect("a token")
}

/// Whether Harvester still takes `token` (a `SelfSubjectReview` with it).
async fn harvester_takes(bed: &TestBed, token: &str) -> bool {
    let url = format!(
        "{}/apis/authentication.k8s.io/v1/selfsubjectreviews",
        bed.harvester.url
    );
    let text =
        testbed::bed::rbac::token_kubeconfig_text(&bed.harvester.url, &bed.pki, token, "default");
    let client = testbed::bed::cluster::client_from_kubeconfig(&text)
        .await
        .expect("a client with the token");
    let review = http::Request::post(url)
        .header("content-type", "application/json")
        .body(
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
                .to_string()
                .into_bytes(),
        )
        .expect("request");
    client.request::<serde_json::Value>(review).await.is_ok()
}

/// Writes `cloud_config` into the chart's Secret, then waits until every program container has
/// logged the switch `times` times in all.
async fn rotate_to(bed: &TestBed, watch: &LogWatch, cloud_config: &str, times: usize, n: usize) {
    let patch = json!({"stringData": {"cloud-config": cloud_config,
                                      "cloud-provider-config": cloud_config}});
    Api::<Secret>::namespaced(bed.guest.client.clone(), NAMESPACE)
        .patch(
            CLOUD_CONFIG_SECRET,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("updating the cloud-config Secret");
    wait::until(
        &format!("{n} program containers to switch to the rotated cloud-config ({times})"),
        ROTATION_BOUND,
        || async {
            let mut by_container: BTreeMap<String, usize> = BTreeMap::new();
            for line in watch.matching() {
                *by_container.entry(line.container).or_default() += 1;
            }
            let done = by_container.len() == n && by_container.values().all(|c| *c >= times);
            Ok(if done { Ok(()) } else { Err(by_container) })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

pub async fn cloud_config_rotates_without_a_restart(bed: &TestBed, real: &GuestCluster) {
    let before = holders(bed).await;
    assert!(
        before.len() >= 2,
        "the chart Pods holding the cloud-config: {before:?}"
    );
    let watch = LogWatch::start(
        &real.node.dirs.pod_logs,
        NAMESPACE,
        SWITCHED,
        Duration::from_secs(1),
    );
    // The account whose tokens rotate; what it may do is deploy_rbac's subject, not this one's.
    let ns = bed.vm_namespace.clone();
    let h = bed.harvester.client.clone();
    Api::<ServiceAccount>::namespaced(h.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ACCOUNT}})).expect("SA"),
        )
        .await
        .expect("the rotated account");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{ns}-{ACCOUNT}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": ns}]
    }))
    .expect("binding");
    Api::<ClusterRoleBinding>::all(h.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding the rotated account");
    let server = guest_cluster::harvester_url_from_pods(&bed.harvester).expect("Harvester URL");
    let n = before.len();
    let mut tokens = Vec::new();
    for (i, anchor) in ["rotation-1", "rotation-2"].into_iter().enumerate() {
        let token = bound_token(bed, anchor).await;
        let text = testbed::bed::rbac::token_kubeconfig_text(&server, &bed.pki, &token, &ns);
        rotate_to(bed, &watch, &text, i + 1, n).await;
        tokens.push(token);
    }
    // Both use the second token now: the first is revoked.
    Api::<Secret>::namespaced(h.clone(), &ns)
        .delete("rotation-1", &DeleteParams::default())
        .await
        .expect("revoking the first token");
    // kube-apiserver keeps a token it authenticated for 10 s (its token cache) before it looks
    // at the bound Secret again.
    wait::until(
        "Harvester to refuse the first token once its Secret went",
        Duration::from_secs(30),
        || async {
            Ok(match harvester_takes(bed, &tokens[0]).await {
                false => Ok(()),
                true => Err("still taken"),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        harvester_takes(bed, &tokens[1]).await,
        "the second token works"
    );
    let after = holders(bed).await;
    assert_eq!(
        after, before,
        "a Pod restarted or was replaced for the rotation"
    );
    watch.finish();
}
