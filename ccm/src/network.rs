//! Names of Harvester VM networks (`namespace/name` of a NetworkAttachmentDefinition), as
//! `--management-network` and the Service annotation `cloudprovider.harvesterhci.io/network`
//! give them. A leaf: the flags and the address rules both use it.

use std::fmt;

use harvester_common::names::is_dns1123_label;

/// `namespace/name` of a Harvester VM network (a NetworkAttachmentDefinition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkName {
    pub namespace: String,
    pub name: String,
}

impl NetworkName {
    /// `ns/name`, or a bare `name` in namespace `default` (as upstream normalises the flag).
    pub fn parse(raw: &str) -> Result<NetworkName, String> {
        Self::parse_in(raw, "default")
    }

    /// `ns/name`, or a bare `name` in `namespace`.
    pub fn parse_in(raw: &str, namespace: &str) -> Result<NetworkName, String> {
        let raw = raw.trim();
        let (ns, name) = match raw.split_once('/') {
            Some((ns, name)) => (ns, name),
            None => (namespace, raw),
        };
        if !is_dns1123_label(ns) {
            return Err(format!(
                "namespace {ns:?} is not a DNS-1123 label (expected namespace/name)"
            ));
        }
        if !is_dns1123_subdomain(name) {
            return Err(format!(
                "network name {name:?} is not a DNS-1123 subdomain (expected namespace/name)"
            ));
        }
        Ok(NetworkName {
            namespace: ns.to_string(),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for NetworkName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}
