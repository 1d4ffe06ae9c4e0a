//! Compiles the vendored CSI spec and the kubelet's plugin registration API with protox (pure
//! Rust), so no protoc binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=csi/v1.12.0/csi.proto");
    let fds = protox::compile(["csi.proto"], ["csi/v1.12.0"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("csi_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Methods a service does not implement answer UNIMPLEMENTED, as the CSI spec asks.
        .generate_default_stubs(true)
        .compile_fds(fds)?;

    // k8s.io/kubelet's pluginregistration API: what node-driver-registrar serves to the kubelet.
    println!("cargo:rerun-if-changed=pluginregistration/v0.34.4/api.proto");
    let fds = protox::compile(["api.proto"], ["pluginregistration/v0.34.4"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
