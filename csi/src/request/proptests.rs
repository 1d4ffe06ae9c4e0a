//! Properties of CSI request validation over random capabilities, capacity ranges and strings.

use csi_proto::csi::v1::volume_capability::{AccessMode, BlockVolume, MountVolume};
use proptest::prelude::*;

use super::*;

const MI: u64 = 1 << 20;

fn field() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "volume_capability",
        "volume_capabilities",
        "capacity_range",
        "name",
        "volume_id",
        "staging_target_path",
    ])
}

/// Filesystem names near the supported ones as well as arbitrary text.
fn fs_type() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("ext4".to_string()),
        Just("xfs".to_string()),
        "(?i)(ext4|xfs)",
        "[ a-z0-9]{0,6}",
        any::<String>(),
    ]
}

fn mount_flag() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("ro".to_string()),
        "[a-z_=,0-9]{1,12}",
        "[ \t]{0,2}",
        any::<String>(),
    ]
}

/// Any capability a CO could send, mode numbers outside the enum included.
fn any_capability() -> impl Strategy<Value = VolumeCapability> {
    let access = proptest::option::of(prop_oneof![
        Just(ProtoAccessType::Block(BlockVolume {})),
        (
            fs_type(),
            proptest::collection::vec(mount_flag(), 0..4),
            any::<String>()
        )
            .prop_map(|(fs_type, mount_flags, volume_mount_group)| {
                ProtoAccessType::Mount(MountVolume {
                    fs_type,
                    mount_flags,
                    volume_mount_group,
                })
            }),
    ]);
    let mode = proptest::option::of(prop_oneof![-1i32..10, any::<i32>()]);
    (access, mode).prop_map(|(access_type, mode)| VolumeCapability {
        access_type,
        access_mode: mode.map(|mode| AccessMode { mode }),
    })
}

/// A capability this driver serves, as the typed value.
fn valid_capability() -> impl Strategy<Value = Capability> {
    let access = prop_oneof![
        Just(Access::Block),
        (
            prop::sample::select(SUPPORTED_FS.to_vec()),
            proptest::collection::vec("[a-z_=,0-9]{1,12}", 0..4)
        )
            .prop_map(|(fs, flags)| Access::Mount {
                fs_type: fs.to_string(),
                flags
            }),
    ];
    let mode = prop_oneof![
        Just(Mode::SingleNodeWriter),
        Just(Mode::SingleNodeReaderOnly),
        Just(Mode::MultiNodeMultiWriter)
    ];
    (access, mode)
        .prop_filter("RWX is served for mount volumes only", |(a, m)| {
            !(*a == Access::Block && *m == Mode::MultiNodeMultiWriter)
        })
        .prop_map(|(access, mode)| Capability { access, mode })
}

/// The capability as a CO sends it: `fs_type` in any letter case, or empty for the default.
fn render(cap: &Capability, upper: &[bool], omit_default: bool) -> VolumeCapability {
    let access_type = match &cap.access {
        Access::Block => ProtoAccessType::Block(BlockVolume {}),
        Access::Mount { fs_type, flags } => ProtoAccessType::Mount(MountVolume {
            fs_type: if omit_default && fs_type == DEFAULT_FS {
                String::new()
            } else {
                fs_type
                    .chars()
                    .zip(upper.iter().chain(std::iter::repeat(&false)))
                    .map(|(c, u)| if *u { c.to_ascii_uppercase() } else { c })
                    .collect()
            },
            mount_flags: flags.clone(),
            volume_mount_group: String::new(),
        }),
    };
    let mode = match cap.mode {
        Mode::SingleNodeWriter => ProtoMode::SingleNodeWriter,
        Mode::SingleNodeReaderOnly => ProtoMode::SingleNodeReaderOnly,
        Mode::MultiNodeMultiWriter => ProtoMode::MultiNodeMultiWriter,
    };
    VolumeCapability {
        access_type: Some(access_type),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

/// Whether the driver serves `cap`, from the rules in the CSI doc comments.
fn servable(cap: &VolumeCapability) -> bool {
    // MULTI_NODE_MULTI_WRITER (5) is an NFS-served filesystem: mount only, and it may name nfs.
    let rwx = cap.access_mode.as_ref().is_some_and(|m| m.mode == 5);
    let access_ok = match &cap.access_type {
        None => false,
        Some(ProtoAccessType::Block(_)) => !rwx,
        Some(ProtoAccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() {
                "ext4".to_string()
            } else {
                m.fs_type.to_ascii_lowercase()
            };
            (SUPPORTED_FS.contains(&fs.as_str()) || (rwx && (fs == "nfs" || fs == "nfs4")))
                && m.mount_flags.iter().all(|f| !f.trim().is_empty())
        }
    };
    access_ok
        && cap
            .access_mode
            .as_ref()
            .is_some_and(|m| m.mode == 1 || m.mode == 2 || m.mode == 5)
}

fn capacity(required: i64, limit: i64) -> CapacityRange {
    CapacityRange {
        required_bytes: required,
        limit_bytes: limit,
    }
}

/// Byte counts near the interesting boundaries (MiB multiples, the minimum, zero, negatives).
fn bytes() -> impl Strategy<Value = i64> {
    prop_oneof![
        any::<i64>(),
        -2i64..=2,
        (0i64..4096).prop_map(|m| m * MI as i64),
        (0i64..4096, -2i64..=2).prop_map(|(m, d)| m * MI as i64 + d),
        Just(i64::MAX),
        Just(i64::MIN),
    ]
}

proptest! {
    /// A required string: empty is `<field> is required`, anything else passes unchanged.
    #[test]
    fn required_strings(field in field(), value in prop_oneof![Just(String::new()), any::<String>()]) {
        match required(field, &value) {
            Ok(v) => prop_assert_eq!(v, value.as_str()),
            Err(e) => {
                prop_assert!(value.is_empty());
                prop_assert_eq!(e.to_string(), format!("{field} is required"));
            }
        }
    }

    /// Any capability parses or fails without panicking; it parses exactly when this driver
    /// serves it, and every error names the field.
    #[test]
    fn any_capability_parses_or_names_the_field(field in field(), cap in any_capability()) {
        match Capability::parse(field, &cap) {
            Ok(_) => prop_assert!(servable(&cap), "{cap:?} accepted"),
            Err(e) => {
                prop_assert!(!servable(&cap), "{cap:?} rejected: {e}");
                prop_assert!(e.to_string().starts_with(&format!("{field}: ")), "{e}");
            }
        }
    }

    /// A served capability, sent with `fs_type` in any case (or empty for ext4), parses back
    /// to the value it was built from.
    #[test]
    fn valid_capabilities_round_trip(
        field in field(),
        cap in valid_capability(),
        upper in proptest::collection::vec(any::<bool>(), 4),
        omit_default in any::<bool>(),
    ) {
        let proto = render(&cap, &upper, omit_default);
        prop_assert_eq!(Capability::parse(field, &proto).unwrap(), cap.clone());
        prop_assert_eq!(capability(field, Some(&proto)).unwrap(), cap);
    }

    /// A list: empty is `<field> is required`; otherwise it parses when every element does, to
    /// the elements in order, else fails naming the field.
    #[test]
    fn capability_lists(field in field(), caps in proptest::collection::vec(any_capability(), 0..4)) {
        match capabilities(field, &caps) {
            Ok(parsed) => {
                prop_assert!(!caps.is_empty() && caps.iter().all(servable));
                let each: Vec<Capability> =
                    caps.iter().map(|c| Capability::parse(field, c).unwrap()).collect();
                prop_assert_eq!(parsed, each);
            }
            Err(e) if caps.is_empty() => prop_assert_eq!(e.to_string(), format!("{field} is required")),
            Err(e) => {
                prop_assert!(!caps.iter().all(servable));
                prop_assert!(e.to_string().starts_with(&format!("{field}: ")), "{e}");
            }
        }
    }

    /// Any capacity range gives a size or an error naming the field, never a panic. A size is a
    /// 2 MiB multiple, at least the minimum and `required_bytes`, less than 2 MiB above the larger
    /// of the two, and within a non-zero limit; an error happens exactly when a bound is
    /// negative or no such size exists.
    #[test]
    fn any_capacity_range(field in field(), required in bytes(), limit in bytes(), absent in any::<bool>()) {
        let range = (!absent).then(|| capacity(required, limit));
        let (required, limit) = if absent { (0, 0) } else { (required, limit) };
        let result = volume_size(field, range.as_ref());
        let smallest = (required.max(0) as u64).max(MIN_VOLUME_BYTES).next_multiple_of(SIZE_ALIGN);
        let possible = required >= 0 && limit >= 0 && (limit == 0 || smallest <= limit as u64);
        match result {
            Ok(size) => {
                prop_assert!(possible);
                prop_assert_eq!(size, smallest);
                prop_assert_eq!(size % SIZE_ALIGN, 0);
                prop_assert!(size >= MIN_VOLUME_BYTES && size >= required as u64);
                prop_assert!(size - (required as u64).max(MIN_VOLUME_BYTES) < SIZE_ALIGN);
                prop_assert!(limit == 0 || size <= limit as u64);
            }
            Err(e) => {
                prop_assert!(!possible, "{e}");
                prop_assert!(e.to_string().starts_with(&format!("{field}: ")), "{e}");
                // OUT_OF_RANGE only when the bounds are consistent but rounding overshoots.
                let out_of_range = matches!(e, ArgError::OutOfRange { .. });
                let consistent = required >= 0 && limit > 0 && required <= limit;
                prop_assert_eq!(out_of_range, consistent, "{}", e);
            }
        }
    }

    /// A size this driver would provision, asked for exactly or anywhere in the 2 MiB step
    /// below it, with no limit or any limit at or above it, is what it gets.
    #[test]
    fn provisionable_sizes_round_trip(steps in 5u64..1_000_000, below in 0u64..SIZE_ALIGN, slack in prop_oneof![Just(None), Just(Some(0u64)), (0u64..1 << 40).prop_map(Some)]) {
        let size = steps * SIZE_ALIGN;
        let required = if size > MIN_VOLUME_BYTES { size - below } else { size };
        let limit = slack.map_or(0, |s| size + s);
        let range = capacity(required as i64, limit as i64);
        prop_assert_eq!(volume_size("capacity_range", Some(&range)).unwrap(), size);
    }
}

/// Paths a CO (or a hostile caller) could send as a staging or target path: absolute clean
/// ones, relative ones, option-like ones (`-o...`), with `.`/`..` or empty components,
/// over-long components and paths, NUL bytes, and what a non-UTF-8 path becomes on a UTF-8
/// wire (protobuf `string` fields refuse invalid UTF-8 before a handler runs, so a lossy
/// conversion is the closest a request can come).
fn any_path() -> impl Strategy<Value = String> {
    let component = prop_oneof![
        8 => "[a-zA-Z0-9_~@:+=-][a-zA-Z0-9._~@:+= -]{0,15}",
        1 => Just(".".to_string()),
        1 => Just("..".to_string()),
        1 => Just(String::new()),
        1 => (250usize..262).prop_map(|n| "c".repeat(n)),
        1 => "[^/\u{0}]{1,8}",
    ];
    let absolute = proptest::collection::vec(component.clone(), 1..8)
        .prop_map(|parts| format!("/{}", parts.join("/")));
    prop_oneof![
        4 => absolute.clone(),
        1 => absolute.clone().prop_map(|p| format!("{p}/")),
        1 => proptest::collection::vec(component, 1..5).prop_map(|parts| parts.join("/")),
        1 => "-o[a-z,=]{0,12}",
        1 => Just(String::new()),
        1 => Just("/".to_string()),
        // Around PATH_MAX: 4051 to 4154 bytes.
        1 => (405usize..415).prop_map(|n| format!("/{}end", "component/".repeat(n))),
        1 => absolute.prop_map(|p| format!("{p}\u{0}x")),
        1 => proptest::collection::vec(any::<u8>(), 1..40)
            .prop_map(|b| format!("/{}", String::from_utf8_lossy(&b))),
        1 => any::<String>(),
    ]
}

/// The rule, written from the kernel's and kubelet's side: non-empty, absolute, at most 4095
/// bytes, no NUL, not `/` itself, and every component a real name of at most 255 bytes.
fn acceptable(p: &str) -> bool {
    !p.is_empty()
        && p.starts_with('/')
        && p.len() <= 4095
        && !p.contains('\0')
        && p != "/"
        && p[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && c.len() <= 255)
}

proptest! {
    /// Any path is accepted exactly when it is absolute and clean, unchanged; every refusal
    /// names the field and shows the value (cut, for long ones), and nothing panics.
    #[test]
    fn node_paths_are_absolute_and_clean(field in field(), path in any_path()) {
        match node_path(field, &path) {
            Ok(p) => {
                prop_assert!(acceptable(&path), "{path:?} accepted");
                prop_assert_eq!(p.as_os_str(), std::ffi::OsStr::new(&path));
                // Lexically it is the root then plain names: it cannot climb out of its
                // parent or resolve against the plugin's working directory.
                let mut comps = p.components();
                prop_assert_eq!(comps.next(), Some(std::path::Component::RootDir));
                prop_assert!(comps.all(|c| matches!(c, std::path::Component::Normal(_))));
            }
            Err(e) => {
                prop_assert!(!acceptable(&path), "{path:?} refused: {e}");
                let msg = e.to_string();
                if path.is_empty() {
                    prop_assert_eq!(msg, format!("{field} is required"));
                } else {
                    prop_assert!(msg.starts_with(&format!("{field}: ")), "{msg}");
                    let head: String = path.chars().take(20).collect();
                    let shown = format!("{head:?}");
                    prop_assert!(msg.contains(shown.trim_end_matches('"')), "{msg} shows {head:?}");
                    prop_assert!(msg.len() < 700, "bounded message: {} bytes", msg.len());
                }
            }
        }
    }

    /// A NodeStage/NodePublish target that is not absolute and clean is never what the
    /// stats/expand side calls a published path either: the two agree.
    #[test]
    fn path_problem_and_node_path_agree(path in any_path()) {
        let problem = path_problem(&path);
        match node_path("target_path", &path) {
            Ok(_) => prop_assert!(problem.is_none()),
            Err(ArgError::Missing { .. }) => prop_assert!(path.is_empty()),
            Err(e) => {
                let reason = problem.expect("a refused path has a problem");
                prop_assert!(e.to_string().ends_with(&reason), "{e} / {reason}");
            }
        }
    }

    /// Capacity ranges of NodeExpandVolume: negative bounds are refused naming the field and
    /// the value; others give the bounds back.
    #[test]
    fn range_bytes_refuses_negative_bounds(required in bytes(), limit in bytes()) {
        let range = capacity(required, limit);
        match range_bytes("capacity_range", Some(&range)) {
            Ok((r, l)) => {
                prop_assert!(required >= 0 && limit >= 0);
                prop_assert_eq!((r, l), (required as u64, limit as u64));
            }
            Err(e) => {
                prop_assert!(required < 0 || limit < 0);
                let msg = e.to_string();
                let bad = if required < 0 { required } else { limit };
                prop_assert!(msg.starts_with("capacity_range: ") && msg.contains(&bad.to_string()), "{msg}");
            }
        }
    }

    /// xfs: any range gives a size of at least 300 MiB or OUT_OF_RANGE naming mkfs.xfs; the
    /// same range without xfs never gives less than with it.
    #[test]
    fn xfs_sizes_respect_the_mkfs_minimum(required in bytes(), limit in bytes()) {
        let range = capacity(required, limit);
        let plain = volume_size("capacity_range", Some(&range));
        match volume_size_at_least("capacity_range", Some(&range), fs_floor("xfs")) {
            Ok(size) => {
                prop_assert!(size >= XFS_MIN_BYTES && size % SIZE_ALIGN == 0);
                prop_assert!(limit <= 0 || size <= limit as u64);
                prop_assert_eq!(size, plain.unwrap().max(XFS_MIN_BYTES));
            }
            Err(ArgError::OutOfRange { reason, .. }) => {
                prop_assert!(limit > 0 && required >= 0);
                if plain.is_ok() {
                    prop_assert!(reason.contains("mkfs.xfs"), "{reason}");
                }
            }
            Err(e) => prop_assert!(plain.is_err(), "{e}"),
        }
    }
}
