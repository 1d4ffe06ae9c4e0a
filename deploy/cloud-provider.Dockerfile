# syntax=docker/dockerfile:1
# harvester-cloud-provider image: the binary on a minimal runtime (glibc, libgcc, CA roots).
# Build from the repository root:
#   docker build -f deploy/cloud-provider.Dockerfile -t <registry>/harvester-cloud-provider:0.1.0 .
# (`make images` builds an equivalent image without a container engine: docs/install.md, "Images".)

# Debian 12 to match the runtime's glibc; the toolchain the repository is tested with.
FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# Only this binary and its crates (csi-proto compiles csi.proto with protox: no protoc needed).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo rustc --release --locked -p harvester-cloud-provider --bin harvester-cloud-provider \
       -- -C target-feature=+crt-static -C link-arg=-Wl,-z,pack-relative-relocs \
    && install -D -m 0755 target/release/harvester-cloud-provider /out/harvester-cloud-provider

# distroless/cc: the binary links glibc statically (static-pie); the image adds the CA
# certificates and the /etc files its resolver reads, nothing else (no shell, no package
# manager). Runs as root: it reads the root-owned cloud-config file from the node, and the
# chart drops every capability but NET_RAW and NET_BIND_SERVICE (DHCP mode).
FROM gcr.io/distroless/cc-debian12
COPY --from=build /out/harvester-cloud-provider /usr/bin/harvester-cloud-provider
ENTRYPOINT ["/usr/bin/harvester-cloud-provider"]
