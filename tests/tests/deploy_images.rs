//! Images in the charts (docs/install.md, "Images"): no default repository for our images (none
//! is published), so `helm template` without it fails with one line naming the value to set; a
//! registry or repository that is not one fails naming it; Rancher's
//! `global.cattle.systemDefaultRegistry` prefixes every image as upstream's charts do; pull
//! secrets in both spellings (`imagePullSecrets`, `global.cattle.imagePullSecrets`) reach every
//! pod; the default tag is the version `make images` tags.
//!
//! Needs helm (tests/scripts/tools.sh): `cargo test -p testbed --test deploy_images`.

use std::path::Path;

use serde_json::{Value, json};
use testbed::suites::deploy::*;

/// The value naming our image in each chart.
const OWN_IMAGE: [(&str, &str); 2] = [
    (CCM_CHART, "image.repository"),
    (CSI_CHART, "image.harvester.csiDriver.repository"),
];

/// `helm template` of the chart with values.yaml alone and `--set` pairs (no
/// ci/default-values.yaml): Err(helm's output) when it fails.
fn template_bare(chart: &str, set: &[&str]) -> Result<String, String> {
    let dir = chart_dir(chart).to_string_lossy().to_string();
    let mut args = vec!["template", chart, &dir, "--namespace", RELEASE_NAMESPACE];
    for s in set {
        args.extend(["--set", s]);
    }
    run_helm(&args)
}

/// The one line of helm's error output that says what failed (`Error: ...`), after checking
/// that it is the only one.
fn error_line(output: &str) -> String {
    let errors: Vec<&str> = output.lines().filter(|l| l.starts_with("Error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected in:\n{output}");
    errors[0].to_string()
}

/// Every container image of every workload, as (workload/container, image).
fn images(docs: &[Value]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for d in docs {
        let Some(containers) = d["spec"]["template"]["spec"]["containers"].as_array() else {
            continue;
        };
        for c in containers {
            out.push((
                format!(
                    "{}/{}",
                    d["metadata"]["name"].as_str().unwrap_or("?"),
                    c["name"]
                ),
                c["image"].as_str().expect("an image").to_string(),
            ));
        }
    }
    out
}

/// The pod specs' imagePullSecrets by workload name.
fn pull_secrets(docs: &[Value]) -> Vec<(String, Value)> {
    docs.iter()
        .filter(|d| d["spec"]["template"]["spec"].is_object())
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap_or("?").to_string(),
                d["spec"]["template"]["spec"]["imagePullSecrets"].clone(),
            )
        })
        .collect()
}

fn write_values(dir: &Path, name: &str, values: Value) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, values.to_string()).expect("writing values");
    path
}

#[test]
fn a_chart_without_our_image_fails_with_one_line_naming_the_value() {
    for (chart, key) in OWN_IMAGE {
        for set in [&[][..], &[&format!("{key}=") as &str][..]] {
            let out = template_bare(chart, set).expect_err("rendering without our image");
            let line = error_line(&out);
            assert!(
                line.contains(&format!("{key} is not set"))
                    && line.contains("make images")
                    && line.contains("docs/install.md"),
                "{chart} {set:?}: {line}"
            );
        }
        // Set, it renders (values.yaml's defaults otherwise).
        let set = format!("{key}=registry.example.com/{chart}");
        template_bare(chart, &[&set]).unwrap_or_else(|e| panic!("{chart} with {set}: {e}"));
    }
}

#[test]
fn a_registry_or_repository_that_is_none_fails_naming_it() {
    for (chart, key) in OWN_IMAGE {
        let own = format!("{key}=team/{chart}");
        // (--set pairs, what the one error line must say)
        let cases: Vec<(Vec<String>, String)> = vec![
            (
                vec![format!("{key}=https://registry.example.com/{chart}")],
                format!("{key} \"https://registry.example.com/{chart}\" is not an image repository"),
            ),
            (
                vec![format!("{key}=registry.example.com/{chart}:0.1.0")],
                format!("{key} \"registry.example.com/{chart}:0.1.0\" is not an image repository"),
            ),
            (
                vec![format!("{key}=registry.example.com/Team/{chart}")],
                "is not an image repository".to_string(),
            ),
            (
                vec![
                    own.clone(),
                    "global.cattle.systemDefaultRegistry=https://registry.example.com".into(),
                ],
                "global.cattle.systemDefaultRegistry \"https://registry.example.com\" is not a registry"
                    .into(),
            ),
            (
                vec![
                    own.clone(),
                    "global.cattle.systemDefaultRegistry=registry example.com".into(),
                ],
                "global.cattle.systemDefaultRegistry \"registry example.com\" is not a registry"
                    .into(),
            ),
            // RKE2's spelling is named when it is the one set.
            (
                vec![
                    own.clone(),
                    "global.systemDefaultRegistry=http://registry.example.com".into(),
                ],
                "global.systemDefaultRegistry \"http://registry.example.com\" is not a registry"
                    .into(),
            ),
        ];
        for (set, says) in cases {
            let set: Vec<&str> = set.iter().map(String::as_str).collect();
            let out = template_bare(chart, &set).expect_err("a bad image value must not render");
            let line = error_line(&out);
            assert!(line.contains(&says), "{chart} {set:?}: {line}");
        }
    }
}

#[test]
fn system_default_registry_prefixes_every_image() {
    for (chart, key) in OWN_IMAGE {
        let own = format!("{key}=team/{chart}");
        // Without a registry: our image as set, with the chart's appVersion as its tag.
        let docs = parse(&template_bare(chart, &[&own]).expect("rendering"));
        let ours: Vec<String> = images(&docs)
            .into_iter()
            .filter(|(_, i)| i.contains(chart))
            .map(|(_, i)| i)
            .collect();
        assert!(!ours.is_empty(), "{chart}: our image is in no workload");
        for i in &ours {
            assert_eq!(
                *i,
                format!("team/{chart}:{}", testbed::real::images::release::VERSION),
                "{chart}"
            );
        }
        for (value, registry) in [
            (
                "global.cattle.systemDefaultRegistry=registry.example.com:5000",
                "registry.example.com:5000",
            ),
            // A trailing slash is not doubled.
            (
                "global.cattle.systemDefaultRegistry=registry.example.com/mirror/",
                "registry.example.com/mirror",
            ),
            // RKE2's key, read when Rancher's is empty.
            (
                "global.systemDefaultRegistry=rke2.example.com",
                "rke2.example.com",
            ),
        ] {
            let docs = parse(&template_bare(chart, &[&own, value]).expect("rendering"));
            let all = images(&docs);
            assert!(all.len() >= 2, "{chart}: {all:?}");
            for (what, image) in all {
                assert!(
                    image.starts_with(&format!("{registry}/"))
                        && !image[registry.len() + 1..].starts_with('/'),
                    "{chart} {value}: {what} has image {image}"
                );
            }
        }
    }
}

#[test]
fn both_pull_secret_spellings_reach_every_pod() {
    let dir = tempfile::tempdir().expect("temp dir");
    let both = json!({
        "imagePullSecrets": [{"name": "ours"}, "plain", {"name": ""}],
        "global": {"cattle": {"imagePullSecrets": ["rancher", {"name": "ours"}]}},
        "kube-vip": {"imagePullSecrets": [{"name": "kube-vip-only"}]},
    });
    let values = write_values(dir.path(), "both.json", both);
    for chart in [CCM_CHART, CSI_CHART] {
        let docs = template(chart, Some(&values), &[]);
        let pods = pull_secrets(&docs);
        assert!(pods.len() >= 2, "{chart}: {pods:?}");
        for (workload, secrets) in pods {
            let want = if workload == "kube-vip" {
                // kube-vip's own key (its sub-chart's upstream) and Rancher's.
                json!([{"name": "kube-vip-only"}, {"name": "rancher"}, {"name": "ours"}])
            } else {
                json!([{"name": "ours"}, {"name": "plain"}, {"name": "rancher"}])
            };
            assert_eq!(secrets, want, "{chart}: {workload}");
        }
        // Each spelling alone.
        for (name, v, want) in [
            (
                "top.json",
                json!({"imagePullSecrets": ["a"]}),
                json!([{"name": "a"}]),
            ),
            (
                "global.json",
                json!({"global": {"cattle": {"imagePullSecrets": [{"name": "g"}]}}}),
                json!([{"name": "g"}]),
            ),
        ] {
            let docs = template(chart, Some(&write_values(dir.path(), name, v)), &[]);
            for (workload, secrets) in pull_secrets(&docs) {
                if workload != "kube-vip" || name == "global.json" {
                    assert_eq!(secrets, want, "{chart} {name}: {workload}");
                }
            }
        }
        // None: no imagePullSecrets key at all.
        let docs = template(chart, None, &[]);
        for (workload, secrets) in pull_secrets(&docs) {
            assert!(secrets.is_null(), "{chart}: {workload} has {secrets}");
        }
    }
}

#[test]
fn the_default_tag_is_the_version_make_images_tags() {
    for chart in [CCM_CHART, CSI_CHART] {
        let text =
            std::fs::read_to_string(chart_dir(chart).join("Chart.yaml")).expect("Chart.yaml");
        let app: Value = serde_saphyr::from_str(&text).expect("Chart.yaml YAML");
        assert_eq!(
            app["appVersion"],
            testbed::real::images::release::VERSION,
            "{chart}: appVersion and the workspace version (the tag of `make images`) differ"
        );
    }
}
