//! Tests of the flag parser: upstream's defaults, typed values, and refusals that name the
//! flag and the value.

use super::*;

fn config(extra: &[&str]) -> Result<Config, ConfigError> {
    let mut args = vec!["harvester-cloud-provider", "--cloud-config", "/cc"];
    args.extend_from_slice(extra);
    Config::from_args(args)
}

#[test]
fn defaults_match_upstream() {
    let c = Config::from_args(["harvester-cloud-provider"]).unwrap();
    assert_eq!(
        c.cloud_config,
        PathBuf::from(harvester_common::cloud_config::DEFAULT_PATH)
    );
    assert_eq!(c.cluster_name, "kubernetes");
    assert_eq!(c.management_network, None);
    assert!(c.node.addresses.node_ip_cidr.is_empty());
    assert!(c.node.addresses.use_node_annotations);
    assert!(c.node.topology);
    assert_eq!(c.node.concurrency, super::DEFAULT_NODE_SYNCS);
    assert_eq!(c.node.resync, Duration::from_secs(300));
    for name in KNOWN_CONTROLLERS {
        assert!(c.controllers.enabled(name), "{name}");
    }
    assert!(c.cluster_name_warning().is_some());
}

#[test]
fn flags_are_typed() {
    let c = config(&[
        "--cluster-name",
        " \"rke2-a\" ",
        "--management-network",
        "mgmt",
        "--node-ip-cidr",
        "10.0.0.0/24,fd00::/64",
        "--node-exclude-ip-ranges",
        "10.1.0.0/16",
        "--node-exclude-ip-ranges",
        "192.168.1.7",
        "--disable-annotation-alpha-provided-ip-addr",
        "--disable-vmi-controller",
        "--concurrent-node-syncs",
        "4",
        "--node-status-update-frequency",
        "1m30s",
        "--controllers",
        "*,-service-lb-controller",
    ])
    .unwrap();
    assert_eq!(c.cluster_name, "rke2-a");
    assert_eq!(c.cluster_name_warning(), None);
    assert_eq!(
        c.management_network.as_ref().map(ToString::to_string),
        Some("default/mgmt".to_string())
    );
    let a = &c.node.addresses;
    assert_eq!(
        a.node_ip_cidr,
        vec![
            "10.0.0.0/24".parse::<IpNetwork>().unwrap(),
            "fd00::/64".parse().unwrap()
        ]
    );
    assert_eq!(
        a.exclude_ranges,
        vec![
            "10.1.0.0/16".parse::<IpNetwork>().unwrap(),
            "192.168.1.7/32".parse().unwrap()
        ]
    );
    assert!(!a.use_node_annotations);
    assert_eq!(a.management_network, c.management_network);
    assert!(!c.node.topology);
    assert_eq!(c.node.concurrency, 4);
    assert_eq!(c.node.resync, Duration::from_secs(90));
    assert!(c.controllers.enabled(CLOUD_NODE_CONTROLLER));
    assert!(!c.controllers.enabled(SERVICE_LB_CONTROLLER));
}

#[test]
fn bad_values_name_the_flag_and_the_value() {
    // (flag, value given, value the error names)
    let cases: &[(&str, &str, &str)] = &[
        ("--node-ip-cidr", "10.0.0.0/33", "10.0.0.0/33"),
        ("--node-ip-cidr", "banana", "banana"),
        ("--node-ip-cidr", "127.0.0.0/8", "127.0.0.0/8"),
        ("--node-ip-cidr", "169.254.0.0/16", "169.254.0.0/16"),
        ("--node-ip-cidr", "fe80::/10", "fe80::/10"),
        ("--node-ip-cidr", "224.0.0.0/4", "224.0.0.0/4"),
        ("--node-ip-cidr", "0.0.0.0/0", "0.0.0.0/0"),
        ("--node-ip-cidr", "255.255.255.255", "255.255.255.255"),
        ("--node-ip-cidr", "10.0.0.0/8,10.1.0.0/16", "10.1.0.0/16"),
        ("--node-exclude-ip-ranges", "10.0.0", "10.0.0"),
        ("--management-network", "a/b/c", "a/b/c"),
        ("--management-network", "Default/mgmt", "Default/mgmt"),
        ("--management-network", "/mgmt", "/mgmt"),
        ("--controllers", "cloud-nod", "cloud-nod"),
        ("--controllers", "-route-controller", "-route-controller"),
        ("--concurrent-service-syncs", "0", "0"),
        ("--master", "not a url", "not a url"),
        ("--concurrent-node-syncs", "0", "0"),
        ("--node-status-update-frequency", "5", "5"),
        ("--node-status-update-frequency", "5d", "5d"),
        ("--node-status-update-frequency", "0", "0"),
    ];
    for (flag, given, value) in cases {
        let args = [*flag, *given];
        let err = config(&args).expect_err(&format!("{args:?} must be refused"));
        assert_eq!((err.flag, err.value.as_str()), (*flag, *value), "{args:?}");
        let text = err.to_string();
        assert!(text.contains(flag) && text.contains(value), "{text}");
    }
}

#[test]
fn go_durations() {
    for (s, d) in [
        ("0", Duration::ZERO),
        ("300ms", Duration::from_millis(300)),
        ("30s", Duration::from_secs(30)),
        ("5m", Duration::from_secs(300)),
        ("5m0s", Duration::from_secs(300)),
        ("1h30m", Duration::from_secs(5400)),
        ("1.5h", Duration::from_secs(5400)),
    ] {
        assert_eq!(parse_go_duration(s), Ok(d), "{s}");
    }
    for s in ["", "5", "m", "5x", "-5s", "1..2s"] {
        assert!(parse_go_duration(s).is_err(), "{s}");
    }
}

#[test]
fn controllers_selection() {
    let c = |v: &[&str]| {
        Controllers::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    };
    let only_node = c(&["cloud-node-controller"]);
    assert!(only_node.enabled(CLOUD_NODE_CONTROLLER));
    assert!(!only_node.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
    let no_lb = c(&["*", "-service-lb-controller"]);
    assert!(no_lb.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
    assert!(!no_lb.enabled(SERVICE_LB_CONTROLLER));
}

#[test]
fn network_names() {
    let n = NetworkName::parse("mgmt-vlan").unwrap();
    assert_eq!(n.to_string(), "default/mgmt-vlan");
    let n = NetworkName::parse_in("vlan1", "guest-vms").unwrap();
    assert_eq!(n.to_string(), "guest-vms/vlan1");
    assert_eq!(
        NetworkName::parse("ns1/net.a").unwrap(),
        NetworkName {
            namespace: "ns1".into(),
            name: "net.a".into()
        }
    );
}
