# syntax=docker/dockerfile:1
# harvester-csi-driver image: the binary plus the filesystem tools the node plugin runs
# (mkfs.ext4/resize2fs from e2fsprogs, mkfs.xfs/xfs_growfs from xfsprogs, blkid and nsenter (RWX
# mounts in the host's network namespace under upstream's chart) from util-linux,
# mount/umount from mount, mount.nfs from nfs-common for RWX volumes). The same image serves
# --mode controller (which runs none of them).
# Build from the repository root:
#   docker build -f deploy/csi-driver.Dockerfile -t <registry>/harvester-csi-driver:0.1.0 .
# (`make images` builds an equivalent image without a container engine: docs/install.md, "Images".)

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo rustc --release --locked -p harvester-csi-driver --bin harvester-csi-driver \
       -- -C target-feature=+crt-static -C link-arg=-Wl,-z,pack-relative-relocs \
    && install -D -m 0755 target/release/harvester-csi-driver /out/harvester-csi-driver

FROM docker.io/library/debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends e2fsprogs xfsprogs util-linux mount nfs-common \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/harvester-csi-driver /usr/bin/harvester-csi-driver
ENTRYPOINT ["/usr/bin/harvester-csi-driver"]
