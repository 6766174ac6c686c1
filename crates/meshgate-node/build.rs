//! Compiles the kubelet's plugin-registration, DRA v1 and DRA health protos (proto/) with protox,
//! a protobuf compiler in Rust, and generates the tonic servers and clients from the descriptors.

const PROTOS: [&str; 3] = [
    "proto/pluginregistration/v1/api.proto",
    "proto/dra/v1/api.proto",
    "proto/dra-health/v1alpha1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
