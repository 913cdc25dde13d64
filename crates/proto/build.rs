//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = "../../proto";
    println!("cargo:rerun-if-changed={proto_root}");
    let descriptors = protox::compile(["tally/v1/log.proto"], [proto_root])?;
    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
