//! Harvester `Setting`s (`harvesterhci.io/v1beta1`, cluster-scoped) and what this project reads of
//! them: `server-version`, which says how KubeVirt hot-plugs volumes on that Harvester.

use std::borrow::Cow;

use kube::api::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::Rest;

/// The setting holding Harvester's version (`v1.8.0`, or a development name).
pub const SERVER_VERSION: &str = "server-version";

/// A Harvester setting: `value` wins over `default` (harvester/harvester
/// `pkg/apis/harvesterhci.io/v1beta1/settings.go`, `EffectiveValue`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Setting {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

impl Setting {
    /// `value` when set and not empty, else `default` (empty when neither is).
    pub fn effective_value(&self) -> &str {
        match self.value.as_deref() {
            Some(v) if !v.is_empty() => v,
            _ => self.default.as_deref().unwrap_or(""),
        }
    }
}

impl kube::Resource for Setting {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Setting".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "harvesterhci.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1beta1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "settings".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// How volumes are hot-plugged into a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HotplugMode {
    /// KubeVirt's `addvolume`/`removevolume` subresources (feature gate `HotplugVolumes`).
    Subresource,
    /// JSON patches of the VM spec (feature gate `DeclarativeHotplugVolumes`, Harvester >= v1.8).
    Declarative,
}

impl std::fmt::Display for HotplugMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HotplugMode::Subresource => "addvolume/removevolume subresources",
            HotplugMode::Declarative => "declarative (VM spec patches)",
        })
    }
}

impl HotplugMode {
    /// The mode a Harvester of version `server_version` uses, as upstream decides it
    /// (harvester-csi-driver `pkg/utils/version.go` `IsVersionAtLeast(v, 1, 8)`): a valid Go
    /// semantic version (`golang.org/x/mod/semver`, leading `v`) at least v1.8.0-0 is declarative,
    /// and so is anything that is not a valid version (a development build: "the latest").
    pub fn for_server_version(server_version: &str) -> HotplugMode {
        match go_semver_major_minor(server_version) {
            Some(v) if v < (1, 8) => HotplugMode::Subresource,
            _ => HotplugMode::Declarative,
        }
    }
}

/// `(major, minor)` of `v` if it is valid for `golang.org/x/mod/semver`: `vMAJOR[.MINOR[.PATCH]]`
/// (the short forms without prerelease or build), numbers without leading zeros, then an optional
/// `-prerelease` and `+build` of dot-separated `[0-9A-Za-z-]` identifiers (numeric prerelease
/// identifiers without leading zeros). Every prerelease of x.y sorts at or above x.y.0-0.
fn go_semver_major_minor(v: &str) -> Option<(u64, u64)> {
    let rest = v.strip_prefix('v')?;
    let (core, build) = match rest.split_once('+') {
        Some((c, b)) => (c, Some(b)),
        None => (rest, None),
    };
    let (core, pre) = match core.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (core, None),
    };
    let number = |s: &str| -> Option<u64> {
        let ok = !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'));
        if ok { s.parse().ok() } else { None }
    };
    let idents_ok = |s: &str, numeric_no_zero: bool| {
        s.split('.').all(|id| {
            !id.is_empty()
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !(numeric_no_zero
                    && id.bytes().all(|b| b.is_ascii_digit())
                    && id.len() > 1
                    && id.starts_with('0'))
        })
    };
    let parts: Vec<&str> = core.split('.').collect();
    if parts.len() < 3 && (pre.is_some() || build.is_some()) {
        return None;
    }
    if parts.len() > 3 {
        return None;
    }
    let nums: Vec<u64> = parts.iter().map(|p| number(p)).collect::<Option<_>>()?;
    if pre.is_some_and(|p| !idents_ok(p, true)) || build.is_some_and(|b| !idents_ok(b, false)) {
        return None;
    }
    Some((nums[0], nums.get(1).copied().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hot_plug_mode_follows_the_harvester_version_as_upstream() {
        use HotplugMode::*;
        // harvester-csi-driver pkg/utils/version.go (commit 2e0eea83): IsVersionAtLeast(v, 1, 8)
        // = !semver.IsValid(v) || semver.Compare(v, "v1.8.0-0") >= 0.
        for (version, want) in [
            ("v1.7.1", Subresource),
            ("v1.7.99", Subresource),
            ("v1.4.0-rc3", Subresource),
            ("v0.3.0", Subresource),
            ("v1", Subresource),
            ("v1.7", Subresource),
            ("v1.8.0", Declarative),
            ("v1.8.0-rc1", Declarative),
            ("v1.8.0-0", Declarative),
            ("v1.8", Declarative),
            ("v1.9.2+build.5", Declarative),
            ("v2.0.0", Declarative),
            // Not valid for x/mod/semver: "the latest".
            ("1.7.0", Declarative),
            ("master-abc123-head", Declarative),
            ("", Declarative),
            ("v1.7.0.1", Declarative),
            ("v01.7.0", Declarative),
            ("v1.7-rc1", Declarative),
            ("v1.7.0-rc.01", Declarative),
            ("v1.7.0-", Declarative),
        ] {
            assert_eq!(
                HotplugMode::for_server_version(version),
                want,
                "server-version {version:?}"
            );
        }
    }

    #[test]
    fn value_wins_over_default() {
        let s = |value: Option<&str>, default: Option<&str>| Setting {
            value: value.map(Into::into),
            default: default.map(Into::into),
            ..Default::default()
        };
        assert_eq!(
            s(Some("v1.8.0"), Some("v1.7.0")).effective_value(),
            "v1.8.0"
        );
        assert_eq!(s(Some(""), Some("v1.7.0")).effective_value(), "v1.7.0");
        assert_eq!(s(None, None).effective_value(), "");
    }
}
