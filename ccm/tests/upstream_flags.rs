//! Every flag upstream's harvester-cloud-provider binary accepts is accepted here, with pflag's
//! semantics. The list is not ours: `data/upstream-ccm-flags.tsv` is generated from
//! k8s.io/cloud-provider's own option set (tests/scripts/upstream-flags/generate.sh), and
//! Harvester's own flags are copied below from upstream's main.go.

use harvester_cloud_provider::config::upstream::WITHOUT_EFFECT;
use harvester_cloud_provider::config::{
    CLOUD_NODE_CONTROLLER, CLOUD_NODE_LIFECYCLE_CONTROLLER, Config, NODE_ROUTE_CONTROLLER,
    SERVICE_LB_CONTROLLER, parse_args,
};
use harvester_common::flags::{GoType, Outcome};

/// Harvester's own flags: harvester/cloud-provider-harvester main.go `registerHarvesterFlags`
/// (the version with `--loadbalancer-network`) and pkg/utils/consts.go. (name, pflag type)
const HARVESTER_FLAGS: &[(&str, &str)] = &[
    ("disable-vmi-controller", "bool"),
    ("disable-annotation-alpha-provided-ip-addr", "bool"),
    ("management-network", "string"),
    ("node-ip-cidr", "string"),
    ("node-exclude-ip-ranges", "stringSlice"),
    ("loadbalancer-network", "string"),
    ("show-full-help-on-error", "bool"),
];

/// The `extraArgs` upstream documents (harvester/charts values.yaml and questions.yml,
/// cloud-provider-harvester README/main.go), each as a user writes it.
const DOCUMENTED_EXTRA_ARGS: &[&str] = &[
    "--disable-annotation-alpha-provided-ip-addr=true",
    "--show-full-help-on-error=true",
    "--leader-elect",
    "--controllers=cloud-node,service",
    "--cluster-name=from-extra-args",
];

#[derive(Debug)]
struct UpstreamFlag {
    name: String,
    ty: String,
    /// pflag's NoOptDefVal: the value of the bare form, if it has one.
    bare: String,
    shorthand: String,
}

fn upstream_flags() -> Vec<UpstreamFlag> {
    let data = include_str!("data/upstream-ccm-flags.tsv");
    let mut flags: Vec<UpstreamFlag> = data
        .lines()
        .filter(|l| l.starts_with("flag\t"))
        .map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            UpstreamFlag {
                name: cols[1].to_string(),
                ty: cols[2].to_string(),
                bare: cols.get(4).unwrap_or(&"").to_string(),
                shorthand: cols.get(5).unwrap_or(&"").to_string(),
            }
        })
        .collect();
    assert!(
        flags.len() > 60,
        "the generated data must hold the framework's whole option set, got {}",
        flags.len()
    );
    for (name, ty) in HARVESTER_FLAGS {
        flags.push(UpstreamFlag {
            name: name.to_string(),
            ty: ty.to_string(),
            bare: if *ty == "bool" {
                "true".into()
            } else {
                String::new()
            },
            shorthand: String::new(),
        });
    }
    flags
}

/// A value upstream would take for a flag of this type (a few names need a specific one).
fn sample(f: &UpstreamFlag) -> &'static str {
    match f.name.as_str() {
        "master" => "https://127.0.0.1:6443",
        "leader-elect-resource-lock" => "leases",
        "logging-format" => "text",
        "controllers" => "*",
        "version" => "false",
        "node-ip-cidr" => "10.0.0.0/24",
        "node-exclude-ip-ranges" => "10.1.0.0/16",
        "management-network" => "default/mgmt",
        "node-status-update-frequency" => "5m",
        "leader-elect-renew-deadline" => "10s",
        "leader-elect-lease-duration" => "15s",
        "metrics-address" => ":10268",
        _ => match f.ty.as_str() {
            "bool" => "true",
            "int" | "int32" | "Level" | "uint32" => "1",
            "float32" => "20",
            "duration" => "30s",
            "ip" => "0.0.0.0",
            "mapStringBool" => "SomeGate=true",
            "mapStringString" => "a=b",
            "namedCertKey" => "c.pem,k.pem",
            "version" => "false",
            "quantity" => "64Ki",
            "pattern=N,..." => "node*=4",
            _ => "x",
        },
    }
}

fn parse(args: &[String]) -> Result<Config, String> {
    let argv = std::iter::once("harvester-cloud-provider".to_string()).chain(args.iter().cloned());
    let parsed = parse_args(argv).map_err(|o| format!("{o:?}"))?;
    Config::from_flags(parsed.flags).map_err(|e| e.to_string())
}

fn refused(args: &[&str]) -> String {
    let argv = std::iter::once("harvester-cloud-provider").chain(args.iter().copied());
    match parse_args(argv) {
        Err(Outcome::Refused(line)) => {
            assert!(!line.contains('\n'), "one line: {line:?}");
            line
        }
        other => panic!("{args:?} must be refused, got {other:?}"),
    }
}

#[test]
fn every_upstream_flag_is_accepted_in_every_spelling_pflag_takes() {
    let mut failures = Vec::new();
    for f in upstream_flags() {
        if f.name == "help" {
            continue; // prints the help and exits; checked below
        }
        let v = sample(&f);
        let mut forms = vec![
            vec![format!("--{}={v}", f.name)],
            vec![format!("--{}", f.name), v.to_string()],
            // WordSepNormalizeFunc: underscores read as dashes
            vec![format!("--{}={v}", f.name.replace('-', "_"))],
        ];
        if !f.bare.is_empty() {
            // A flag with a bare form (bools, --version) never takes a separate value in pflag.
            forms[1] = vec![format!("--{}=false", f.name)];
        }
        if !f.bare.is_empty() {
            forms.push(vec![format!("--{}", f.name)]);
        }
        if !f.shorthand.is_empty() {
            forms.push(vec![format!("-{}", f.shorthand), v.to_string()]);
        }
        for args in forms {
            if let Err(e) = parse(&args) {
                failures.push(format!("{args:?}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "refused:\n{}", failures.join("\n"));
}

/// What is accepted without effect is upstream's, with upstream's type: no flag upstream lacks
/// slips in (an unknown flag must stay an error), and each value is checked as upstream checks it.
#[test]
fn flags_without_effect_are_upstreams_with_their_types() {
    let upstream = upstream_flags();
    for (name, ty) in WITHOUT_EFFECT {
        let f = upstream
            .iter()
            .find(|f| f.name == *name)
            .unwrap_or_else(|| panic!("--{name} is not a flag of upstream's binary"));
        assert_eq!(
            GoType::from_pflag(&f.ty),
            Some(*ty),
            "--{name}: upstream type {}",
            f.ty
        );
    }
    for f in &upstream {
        assert!(
            GoType::from_pflag(&f.ty).is_some(),
            "--{}: upstream type {} has no check",
            f.name,
            f.ty
        );
    }
}

#[test]
fn all_upstream_flags_at_once_parse() {
    let args: Vec<String> = upstream_flags()
        .iter()
        .filter(|f| f.name != "help" && f.name != "version")
        .map(|f| format!("--{}={}", f.name, sample(f)))
        .collect();
    parse(&args).expect("every upstream flag together");
}

#[test]
fn help_prints_instead_of_failing() {
    for h in ["--help", "-h"] {
        let argv = ["harvester-cloud-provider", h];
        assert!(
            matches!(parse_args(argv), Err(Outcome::Print(t)) if t.contains("--cluster-name")),
            "{h}"
        );
    }
}

#[test]
fn documented_extra_args_alone_and_together() {
    let chart = [
        "--cloud-config=/etc/kubernetes/cloud-config",
        "--cluster-name=rke2-a",
    ];
    for extra in DOCUMENTED_EXTRA_ARGS {
        let args: Vec<String> = chart.iter().chain([extra]).map(|s| s.to_string()).collect();
        parse(&args).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
    let all: Vec<String> = chart
        .iter()
        .chain(DOCUMENTED_EXTRA_ARGS)
        .map(|s| s.to_string())
        .collect();
    let c = parse(&all).expect("all documented extraArgs");
    assert_eq!(
        c.cluster_name, "from-extra-args",
        "pflag: the last one wins"
    );
    assert!(!c.node.addresses.use_node_annotations);
    assert!(c.controllers.enabled(CLOUD_NODE_CONTROLLER));
    assert!(c.controllers.enabled(SERVICE_LB_CONTROLLER));
    assert!(!c.controllers.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
    assert!(!c.controllers.enabled(NODE_ROUTE_CONTROLLER));
}

#[test]
fn repeated_flags_keep_the_last_value_and_slices_append() {
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let c = parse(&s(&["--cluster-name=a", "--cluster-name", "b"])).unwrap();
    assert_eq!(c.cluster_name, "b");
    let c = parse(&s(&[
        "--node-ip-cidr=10.0.0.0/24",
        "--node-ip-cidr=10.9.0.0/24",
    ]))
    .unwrap();
    assert_eq!(c.node.addresses.node_ip_cidr.len(), 1);
    assert_eq!(c.node.addresses.node_ip_cidr[0].to_string(), "10.9.0.0/24");
    let c = parse(&s(&[
        "--node-exclude-ip-ranges=10.1.0.0/16",
        "--node-exclude-ip-ranges=10.2.0.0/16",
    ]))
    .unwrap();
    assert_eq!(
        c.node.addresses.exclude_ranges.len(),
        2,
        "stringSlice appends"
    );
    let c = parse(&s(&["--controllers=-service", "--controllers=*"])).unwrap();
    assert!(
        !c.controllers.enabled(SERVICE_LB_CONTROLLER),
        "-name wins over *"
    );
    let c = parse(&s(&["--leader-elect=false", "--leader-elect"])).unwrap();
    let _ = c; // leader election lives in OpsFlags: parsed above without error
}

#[test]
fn aliases_and_canonical_names_select_the_same_controllers() {
    let s = |v: &str| vec![format!("--controllers={v}")];
    let alias = parse(&s("cloud-node,cloud-node-lifecycle,service,route")).unwrap();
    let full = parse(&s(
        "cloud-node-controller,cloud-node-lifecycle-controller,service-lb-controller,node-route-controller",
    ))
    .unwrap();
    assert_eq!(alias.controllers, full.controllers);
    let minus = parse(&s("*,-cloud-node-lifecycle")).unwrap();
    assert!(!minus.controllers.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
    assert!(minus.controllers.enabled(CLOUD_NODE_CONTROLLER));
}

#[test]
fn aliases_are_upstreams() {
    // The generator prints k8s.io/cloud-provider's names.CCMControllerAliases; ours must agree.
    let data = include_str!("data/upstream-ccm-flags.tsv");
    let mut n = 0;
    for l in data.lines().filter(|l| l.starts_with("alias\t")) {
        let cols: Vec<&str> = l.split('\t').collect();
        let a = parse(&[format!("--controllers={}", cols[1])]).unwrap();
        let b = parse(&[format!("--controllers={}", cols[2])]).unwrap();
        assert_eq!(a.controllers, b.controllers, "{l}");
        n += 1;
    }
    assert!(n >= 4, "aliases in the data: {n}");
    for l in data.lines().filter(|l| l.starts_with("controller\t")) {
        let name = l.split('\t').nth(1).unwrap();
        parse(&[format!("--controllers={name}")]).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn bad_flags_and_values_are_one_line_naming_them() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["--no-such-flag=1"], &["--no-such-flag"]),
        (&["--leader-elect=maybe"], &["--leader-elect", "maybe"]),
        (&["--kube-api-qps=fast"], &["--kube-api-qps", "fast"]),
        (
            &["--concurrent-node-syncs=x"],
            &["--concurrent-node-syncs", "x"],
        ),
        (&["--secure-port=http"], &["--secure-port", "http"]),
        (&["--bind-address=host"], &["--bind-address", "host"]),
        (&["--feature-gates=A=yes"], &["--feature-gates", "A=yes"]),
        (
            &["--leader-elect-resource-lock=endpoints"],
            &["--leader-elect-resource-lock", "endpoints"],
        ),
    ];
    for (args, names) in cases {
        let line = refused(args);
        for n in *names {
            assert!(line.contains(n), "{args:?}: {line:?} must name {n}");
        }
    }
    // `--bool value`: pflag takes `value` as an argument, which the command refuses.
    refused(&["--leader-elect", "false"]);
}
