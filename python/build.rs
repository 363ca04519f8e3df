//! Builds `src/throw.cpp`, the one C++ function the extension needs (see its comment), and
//! links the C++ runtime it throws with.

fn main() {
    println!("cargo:rerun-if-changed=src/throw.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/throw.cpp")
        .compile("emm_throw");
}
