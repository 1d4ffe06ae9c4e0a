//! Choosing the IPPool for a LoadBalancer (`pkg/ipam/selector.go` and the controller's
//! `selectIPPool`): a strict pass, the global pool as fallback, then a loose pass for guest-cluster
//! LoadBalancers only.

use std::fmt;

/// The wildcard in a scope tuple or a requirement field.
pub const WILDCARD: &str = "*";

/// One `spec.selector.scope[*]` tuple (the CR's own type); `"*"` matches anything.
pub use harvester_common::harvester::loadbalancer::PoolScope as Scope;
/// `spec.selector` of an IPPool (the CR's own type).
pub use harvester_common::harvester::loadbalancer::PoolSelector as Selector;

/// The `*`/`*`/`*` tuple that makes a pool global.
pub fn any_scope() -> Scope {
    Scope {
        project: WILDCARD.into(),
        namespace: WILDCARD.into(),
        guest_cluster: WILDCARD.into(),
    }
}

/// Whether the scope is exactly one `*`/`*`/`*` tuple: the rule by which Harvester's webhook
/// labels a pool `loadbalancer.harvesterhci.io/global-ip-pool=true`. (Higher `priority` wins;
/// non-zero values are unique across pools, the webhook enforces it. `network` is
/// `<namespace>/<nad name>`, compared as an exact string; `""` only matches `""`.)
pub fn is_global_scope(selector: &Selector) -> bool {
    matches!(selector.scope.as_slice(), [only] if *only == any_scope())
}

/// What a LoadBalancer asks of a pool, from its annotations
/// (`loadbalancer.harvesterhci.io/{network,project,namespace,cluster}`; namespace defaults to the
/// LB's own namespace, which is the caller's job).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requirement {
    pub network: String,
    pub project: String,
    pub namespace: String,
    pub cluster: String,
}

/// Go's `%+v` of `*ipam.Requirement`, so the Ready message reads exactly like upstream's.
impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "&{{Network:{} Project:{} Namespace:{} Cluster:{}}}",
            self.network, self.project, self.namespace, self.cluster
        )
    }
}

/// What selection needs to know about one IPPool. Ranges are not needed, so a pool whose ranges
/// do not parse can still be selected (and then fail loudly at allocation, as upstream does).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolView {
    pub name: String,
    pub selector: Selector,
    /// The label `loadbalancer.harvesterhci.io/global-ip-pool=true` as read from the CR.
    pub global: bool,
}

impl PoolView {
    /// Global by label, or by the scope shape the label is derived from (in case the label is
    /// missing because the webhook did not run, e.g. in a test bed).
    pub fn is_global(&self) -> bool {
        self.global || is_global_scope(&self.selector)
    }
}

/// No pool matched and there is no global pool. The message matches upstream's
/// `no matched IPPool with requirement &{...}`, which users and the CCM see in the LB's Ready
/// condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no matched IPPool with requirement {requirement}")]
pub struct NoMatchedPool {
    pub requirement: Requirement,
}

/// How forgiving a tuple match is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// `*` on either side, or equal.
    Strict,
    /// Also treats an empty `project` or `guestCluster` in the tuple as a wildcard.
    Loose,
}

/// Picks the pool for `req`:
/// 1. strict pass: network equal and some tuple matching; highest priority wins, ties go to the
///    last pool in list order (upstream compares with `>=`);
/// 2. otherwise the global pool (the last one, if several claim to be global);
/// 3. otherwise, only for `workloadType: cluster`, the loose pass with the same priority rule.
pub fn select_pool<'a>(
    pools: &'a [PoolView],
    req: &Requirement,
    workload_is_cluster: bool,
) -> Result<&'a PoolView, NoMatchedPool> {
    best_match(pools, req, Pass::Strict)
        .or_else(|| pools.iter().rev().find(|p| p.is_global()))
        .or_else(|| {
            workload_is_cluster
                .then(|| best_match(pools, req, Pass::Loose))
                .flatten()
        })
        .ok_or_else(|| NoMatchedPool {
            requirement: req.clone(),
        })
}

/// The matching pool with the highest priority; the later one wins a tie. Global pools take no
/// part: upstream's `Select` sets a labelled global pool aside before matching (load-balancer-
/// harvester `pkg/ipam/selector.go`, v1.8.0 to e861dc94 unchanged), and its IPPool webhook labels
/// exactly the pools of one `*`/`*`/`*` tuple (`pkg/webhook/ippool/mutator.go` `isGlobalIPPool`).
fn best_match<'a>(pools: &'a [PoolView], req: &Requirement, pass: Pass) -> Option<&'a PoolView> {
    pools
        .iter()
        .filter(|p| !p.is_global() && matches(&p.selector, req, pass))
        .fold(None, |best: Option<&PoolView>, p| match best {
            Some(b) if b.selector.priority > p.selector.priority => Some(b),
            _ => Some(p),
        })
}

/// The network must be equal (an empty network only matches an empty one), and some tuple must
/// match.
fn matches(selector: &Selector, req: &Requirement, pass: Pass) -> bool {
    selector.network == req.network && selector.scope.iter().any(|t| tuple_matches(t, req, pass))
}

fn tuple_matches(t: &Scope, req: &Requirement, pass: Pass) -> bool {
    let loose = pass == Pass::Loose;
    field_matches(&t.project, &req.project, loose)
        && field_matches(&t.namespace, &req.namespace, false)
        && field_matches(&t.guest_cluster, &req.cluster, loose)
}

fn field_matches(tuple: &str, wanted: &str, empty_is_wildcard: bool) -> bool {
    tuple == WILDCARD
        || wanted == WILDCARD
        || tuple == wanted
        || (empty_is_wildcard && tuple.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(project: &str, namespace: &str, cluster: &str) -> Scope {
        Scope {
            project: project.into(),
            namespace: namespace.into(),
            guest_cluster: cluster.into(),
        }
    }

    fn pool(name: &str, priority: u32, network: &str, scopes: &[(&str, &str, &str)]) -> PoolView {
        PoolView {
            name: name.into(),
            selector: Selector {
                priority,
                network: network.into(),
                scope: scopes.iter().map(|(p, n, c)| scope(p, n, c)).collect(),
            },
            global: false,
        }
    }

    fn req(network: &str, project: &str, namespace: &str, cluster: &str) -> Requirement {
        Requirement {
            network: network.into(),
            project: project.into(),
            namespace: namespace.into(),
            cluster: cluster.into(),
        }
    }

    fn pick(pools: &[PoolView], r: &Requirement, cluster: bool) -> Option<String> {
        select_pool(pools, r, cluster).ok().map(|p| p.name.clone())
    }

    const NET: &str = "default/vlan10";

    #[test]
    fn selection_rules() {
        let any = ("*", "*", "*");
        // (name, pools, requirement, workload is cluster, expected pool)
        type Row = (
            &'static str,
            Vec<PoolView>,
            Requirement,
            bool,
            Option<&'static str>,
        );
        let rows: Vec<Row> = vec![
            (
                "network must match exactly",
                vec![
                    pool("a", 0, "default/vlan20", &[any]),
                    pool("b", 0, NET, &[any]),
                ],
                req(NET, "p", "ns", "c"),
                true,
                Some("b"),
            ),
            (
                "empty network only matches empty network",
                vec![pool("a", 0, "", &[("p", "ns", "c")])],
                req(NET, "p", "ns", "c"),
                false,
                None,
            ),
            (
                "empty equals empty",
                vec![pool("a", 0, "", &[("p", "ns", "c")])],
                req("", "p", "ns", "c"),
                false,
                Some("a"),
            ),
            (
                "tuple field mismatch",
                vec![pool("a", 0, NET, &[("p", "other", "c")])],
                req(NET, "p", "ns", "c"),
                false,
                None,
            ),
            (
                "any tuple may match",
                vec![pool("a", 0, NET, &[("p", "other", "c"), ("*", "ns", "*")])],
                req(NET, "p", "ns", "c"),
                false,
                Some("a"),
            ),
            (
                "wildcard in the requirement",
                vec![pool("a", 0, NET, &[("p", "ns", "c")])],
                req(NET, "*", "ns", "*"),
                false,
                Some("a"),
            ),
            (
                "highest priority wins",
                vec![
                    pool("hi", 5, NET, &[("*", "ns", "*")]),
                    pool("lo", 1, NET, &[("*", "ns", "*")]),
                ],
                req(NET, "p", "ns", "c"),
                false,
                Some("hi"),
            ),
            (
                "tie goes to the last in list order",
                vec![
                    pool("first", 0, NET, &[("*", "ns", "*")]),
                    pool("last", 0, NET, &[("*", "ns", "*")]),
                ],
                req(NET, "p", "ns", "c"),
                false,
                Some("last"),
            ),
            (
                "strict match beats the global pool",
                vec![
                    pool("global", 0, "", &[any]),
                    pool("a", 0, NET, &[("*", "ns", "*")]),
                ],
                req(NET, "p", "ns", "c"),
                false,
                Some("a"),
            ),
            (
                "a global pool is set aside in the strict pass, whatever its priority",
                vec![
                    pool("a", 0, NET, &[("*", "ns", "*")]),
                    pool("global", 9, NET, &[any]),
                ],
                req(NET, "p", "ns", "c"),
                false,
                Some("a"),
            ),
            (
                "global pool is the fallback whatever its network",
                vec![
                    pool("global", 0, "other/net", &[any]),
                    pool("a", 0, NET, &[("*", "x", "*")]),
                ],
                req(NET, "p", "ns", "c"),
                false,
                Some("global"),
            ),
            (
                "loose pass: empty project and cluster are wildcards for cluster LBs",
                vec![pool("a", 0, NET, &[("", "ns", "")])],
                req(NET, "p", "ns", "c"),
                true,
                Some("a"),
            ),
            (
                "loose pass is not used for vm LBs",
                vec![pool("a", 0, NET, &[("", "ns", "")])],
                req(NET, "p", "ns", "c"),
                false,
                None,
            ),
            (
                "loose pass never relaxes the namespace",
                vec![pool("a", 0, NET, &[("", "", "")])],
                req(NET, "p", "ns", "c"),
                true,
                None,
            ),
            (
                "loose pass never relaxes the network",
                vec![pool("a", 0, "", &[("", "ns", "")])],
                req(NET, "p", "ns", "c"),
                true,
                None,
            ),
            (
                "loose pass: priority then last wins",
                vec![
                    pool("a", 0, NET, &[("", "ns", "")]),
                    pool("b", 3, NET, &[("", "ns", "")]),
                    pool("c", 3, NET, &[("", "ns", "")]),
                ],
                req(NET, "p", "ns", "c"),
                true,
                Some("c"),
            ),
        ];
        for (name, pools, r, cluster, want) in rows {
            assert_eq!(pick(&pools, &r, cluster).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn global_fallback_beats_loose_pass() {
        let mut global = pool("global", 0, "", &[("p", "x", "c")]);
        global.global = true;
        let pools = [pool("loose", 9, NET, &[("", "ns", "")]), global];
        let r = req(NET, "p", "ns", "c");
        assert_eq!(pick(&pools, &r, true).as_deref(), Some("global"));
    }

    #[test]
    fn global_by_label_or_by_scope_shape() {
        assert!(pool("g", 0, "", &[("*", "*", "*")]).is_global());
        assert!(!pool("g", 0, "", &[("*", "*", "*"), ("p", "n", "c")]).is_global());
        assert!(!pool("g", 0, "", &[("*", "*", "")]).is_global());
        let mut labelled = pool("g", 0, "", &[("p", "n", "c")]);
        labelled.global = true;
        assert!(labelled.is_global());
    }

    #[test]
    fn last_global_pool_wins() {
        let pools = [
            pool("g1", 0, "x", &[("*", "*", "*")]),
            pool("g2", 0, "y", &[("*", "*", "*")]),
        ];
        assert_eq!(
            pick(&pools, &req(NET, "p", "ns", "c"), false).as_deref(),
            Some("g2")
        );
    }

    #[test]
    fn error_reads_like_upstream() {
        let err = select_pool(&[], &req(NET, "c-1/p-2", "default", "rke2-a"), true)
            .map(|p| p.name.clone())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "no matched IPPool with requirement &{Network:default/vlan10 Project:c-1/p-2 \
             Namespace:default Cluster:rke2-a}"
        );
    }

    #[test]
    fn selector_has_the_cr_json_shape() {
        let json = r#"{"priority":3,"network":"default/vlan10",
            "scope":[{"project":"*","namespace":"default","guestCluster":"rke2-a"}]}"#;
        let s: Selector = serde_json::from_str(json).unwrap();
        assert_eq!(s.scope, vec![scope("*", "default", "rke2-a")]);
        let empty: Selector = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, Selector::default());
    }
}
