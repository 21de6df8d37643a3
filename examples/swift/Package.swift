// swift-tools-version:5.9
import PackageDescription

let package = Package(
    name: "SpecStreamClient",
    platforms: [.macOS(.v13)],
    products: [
        .library(name: "SpecStreamClient", targets: ["SpecStreamClient"]),
        .executable(name: "specstream-demo", targets: ["specstream-demo"]),
    ],
    targets: [
        .target(name: "SpecStreamClient"),
        .executableTarget(name: "specstream-demo", dependencies: ["SpecStreamClient"]),
        .testTarget(name: "SpecStreamClientTests", dependencies: ["SpecStreamClient"]),
    ]
)
