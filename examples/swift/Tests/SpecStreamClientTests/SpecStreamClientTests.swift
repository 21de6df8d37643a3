import Foundation
import XCTest

@testable import SpecStreamClient

#if canImport(Darwin)
import Darwin
#else
import Glibc
#endif

struct TimedOut: Error {}

/// True for the first caller only.
final class Once: @unchecked Sendable {
    private let lock = NSLock()
    private var done = false
    func claim() -> Bool {
        lock.lock(); defer { lock.unlock() }
        if done { return false }
        done = true
        return true
    }
}

/// `body`'s result, or `TimedOut` after `seconds`: a broken client fails its test instead of
/// hanging. The body runs in its own task and is abandoned on time-out (it may await
/// something that ignores cancellation, which a task group would wait for forever).
func within<T: Sendable>(_ seconds: Double, _ body: @escaping @Sendable () async throws -> T) async throws -> T {
    let once = Once()
    return try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, Error>) in
        Task {
            do {
                let value = try await body()
                if once.claim() { continuation.resume(returning: value) }
            } catch {
                if once.claim() { continuation.resume(throwing: error) }
            }
        }
        Task {
            try? await Task.sleep(nanoseconds: UInt64(seconds * 1e9))
            if once.claim() { continuation.resume(throwing: TimedOut()) }
        }
    }
}

/// Runs the real `specstream-mlx serve --stdio` with the small bundled demo-sql model.
/// The executable comes from `SPECSTREAM_MLX` or the repository's `.venv`.
final class SpecStreamClientTests: XCTestCase {
    static let model = "demo-sql"
    static let prompt = "CREATE TABLE people (name TEXT, age INTEGER)\n-- What is the name of the oldest person?"

    static var executable: URL {
        if let path = ProcessInfo.processInfo.environment["SPECSTREAM_MLX"] {
            return URL(fileURLWithPath: path)
        }
        // Tests/SpecStreamClientTests/<this file> -> repository root is four levels up.
        var url = URL(fileURLWithPath: #filePath)
        for _ in 0..<5 { url.deleteLastPathComponent() }
        return url.appendingPathComponent(".venv/bin/specstream-mlx")
    }

    func makeClient(model: String = SpecStreamClientTests.model) throws -> SpecStreamClient {
        let exe = Self.executable
        try XCTSkipUnless(FileManager.default.isExecutableFile(atPath: exe.path),
                          "no specstream-mlx at \(exe.path); set SPECSTREAM_MLX")
        return try SpecStreamClient(executable: exe, model: model)
    }

    /// `specstream-mlx generate --mode ar --json` for the same prompt, greedy.
    func referenceText(maxTokens: Int) throws -> String {
        let p = Process()
        p.executableURL = Self.executable
        p.arguments = ["generate", "--model", Self.model, "--prompt", Self.prompt, "--mode", "ar",
                       "--max-tokens", String(maxTokens), "--json"]
        let out = Pipe()
        p.standardOutput = out
        p.standardError = FileHandle.nullDevice
        try p.run()
        let data = out.fileHandleForReading.readDataToEndOfFile()
        p.waitUntilExit()
        XCTAssertEqual(p.terminationStatus, 0)
        let obj = try JSONSerialization.jsonObject(with: data) as? [String: Any]
        return try XCTUnwrap(obj?["text"] as? String)
    }

    func collect(_ request: SpecStreamRequest) async -> (tokens: String, done: (String, String)?, error: String?) {
        var tokens = ""
        for await event in request.events {
            switch event {
            case .token(let t): tokens += t
            case .done(let text, let reason, _): return (tokens, (text, reason), nil)
            case .error(let code, _): return (tokens, nil, code)
            }
        }
        return (tokens, nil, "stream ended without done")
    }

    func testReadyEventNamesTheModel() async throws {
        let client = try makeClient()
        let ready = try await within(60) { try await client.waitUntilReady() }
        XCTAssertEqual(ready.model, Self.model)
        XCTAssertTrue(ready.modes.contains("ar"))
        XCTAssertGreaterThan(ready.maxContext, 0)
        client.close()
    }

    func testStreamedGreedyTextEqualsTheCommandLine() async throws {
        let expected = try referenceText(maxTokens: 40)
        let client = try makeClient()
        let result = await collect(client.start(prompt: Self.prompt, maxTokens: 40, mode: "ar"))
        XCTAssertNil(result.error)
        XCTAssertEqual(result.done?.0, expected)
        XCTAssertEqual(result.tokens, expected)  // the streamed deltas add up to the same text
        client.close()
    }

    func testTwoConcurrentRequestsKeepTheirIds() async throws {
        let client = try makeClient()
        let a = client.start(prompt: Self.prompt, maxTokens: 24, mode: "ar")
        let b = client.start(prompt: "CREATE TABLE t (x INTEGER)\n-- How many rows are there?", maxTokens: 24, mode: "ar")
        XCTAssertNotEqual(a.id, b.id)
        async let ra = collect(a)
        async let rb = collect(b)
        let (resA, resB) = await (ra, rb)
        XCTAssertEqual(resA.done?.1 != nil, true)
        XCTAssertEqual(resB.done?.1 != nil, true)
        XCTAssertEqual(resA.tokens, resA.done?.0)
        XCTAssertEqual(resB.tokens, resB.done?.0)
        // each text is the one that prompt gets alone
        let alone = await collect(client.start(prompt: Self.prompt, maxTokens: 24, mode: "ar"))
        XCTAssertEqual(resA.done?.0, alone.done?.0)
        XCTAssertNotEqual(resA.done?.0, resB.done?.0)
        client.close()
    }

    func testCancelEndsTheRequestWithDoneCancelled() async throws {
        let client = try makeClient()
        _ = try await within(60) { try await client.waitUntilReady() }
        let request = client.start(prompt: Self.prompt, maxTokens: 1000, temperature: 100, seed: 1, mode: "ar")
        var reason: String?
        var tokens = 0
        for await event in request.events {
            switch event {
            case .token:
                tokens += 1
                if tokens == 1 { client.cancel(request.id) }
            case .done(_, let r, _): reason = r
            case .error(let code, let message): XCTFail("\(code): \(message)")
            }
        }
        XCTAssertEqual(reason, "cancelled")
        XCTAssertLessThan(tokens, 1000)
        client.close()
    }

    func testServerKilledMidRequestThrowsPromptly() async throws {
        let client = try makeClient()
        _ = try await within(60) { try await client.waitUntilReady() }
        let pid = client.serverProcessIdentifier
        let started = Date()
        do {
            // a long sampled request (313 tokens before its EOS), killed at its first token:
            // still generating when the server dies, however fast this machine decodes
            let request = client.start(prompt: Self.prompt, maxTokens: 1000, temperature: 100, seed: 3, mode: "ar")
            try await within(15) {
                var killed = false
                for await event in request.events {
                    if case .token = event, !killed {
                        killed = true
                        kill(pid, SIGKILL)
                    }
                    if case .error(let code, let message) = event {
                        throw SpecStreamError(code: code, message: message)
                    }
                    if case .done = event { break }
                }
            }
            XCTFail("a request to a killed server must throw")
        } catch let error as SpecStreamError {
            XCTAssertEqual(error.code, "server_exited")
        }
        XCTAssertLessThan(Date().timeIntervalSince(started), 15)
        // and later requests fail at once instead of hanging
        do {
            _ = try await client.complete(prompt: "x")
            XCTFail("expected an error")
        } catch let error as SpecStreamError {
            XCTAssertEqual(error.code, "server_exited")
        }
    }

    func testModelThatCannotLoadIsASwiftError() async throws {
        let client = try makeClient(model: "/nonexistent/model-dir")
        do {
            _ = try await within(60) { try await client.waitUntilReady() }
            XCTFail("expected load_failed")
        } catch let error as SpecStreamError {
            XCTAssertEqual(error.code, "load_failed")
            XCTAssertTrue(error.message.contains("nonexistent"), error.message)
        }
        do {
            _ = try await client.complete(prompt: "hi")
            XCTFail("expected an error")
        } catch let error as SpecStreamError {
            XCTAssertEqual(error.code, "load_failed")
        }
    }

    func testNoBusyLoopAfterEndOfInput() async throws {
        let client = try makeClient()
        _ = try await within(60) { try await client.waitUntilReady() }
        _ = try await client.complete(prompt: Self.prompt, maxTokens: 4, mode: "ar")
        client.close()  // EOF to the server: it exits, its pipes reach end of input
        try await Task.sleep(nanoseconds: 500_000_000)
        let before = cpuSeconds()
        try await Task.sleep(nanoseconds: 2_000_000_000)
        let used = cpuSeconds() - before
        XCTAssertLessThan(used, 0.2, "the client used \(used) s of CPU in 2 s of idling")
    }

    private func cpuSeconds() -> Double {
        var usage = rusage()
        #if canImport(Darwin)
        getrusage(RUSAGE_SELF, &usage)
        #else
        getrusage(RUSAGE_SELF.rawValue, &usage)  // Glibc imports the constant as an enum
        #endif
        let user = Double(usage.ru_utime.tv_sec) + Double(usage.ru_utime.tv_usec) / 1e6
        let sys = Double(usage.ru_stime.tv_sec) + Double(usage.ru_stime.tv_usec) / 1e6
        return user + sys
    }
}
