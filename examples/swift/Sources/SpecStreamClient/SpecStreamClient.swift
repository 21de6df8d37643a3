import Foundation

/// One event of the `specstream-mlx serve --stdio` protocol (docs/PROTOCOL.md).
public enum SpecStreamEvent: Sendable {
    case token(String)
    case done(text: String, finishReason: String, stats: [String: Double])
    case error(code: String, message: String)
}

public struct SpecStreamError: Error, CustomStringConvertible {
    public let code: String
    public let message: String
    public var description: String { "\(code): \(message)" }
}

/// The server's `ready` event: the model loaded.
public struct SpecStreamReady: Sendable {
    public let model: String
    public let modes: [String]
    public let maxContext: Int
}

/// A request in flight: its id (for `cancel`) and its events, ending with `done` or `error`.
public struct SpecStreamRequest: Sendable {
    public let id: String
    public let events: AsyncStream<SpecStreamEvent>
}

/// Starts `specstream-mlx serve --stdio` with Foundation's `Process` and `Pipe`,
/// writes one JSON request per line and yields each request's events as an
/// `AsyncSequence`. The model loads once; requests are answered in order.
public final class SpecStreamClient: @unchecked Sendable {
    private let process = Process()
    private let stdinPipe = Pipe()
    private let stdoutPipe = Pipe()
    private let stderrPipe = Pipe()
    private let lock = NSLock()
    private var continuations: [String: AsyncStream<SpecStreamEvent>.Continuation] = [:]
    private var buffer = Data()
    private var nextId = 0
    /// Set once the server process has exited or its pipes closed: later requests fail at once.
    private var serverGone: SpecStreamError?
    private var ready: SpecStreamReady?
    private var readyWaiters: [CheckedContinuation<SpecStreamReady, Error>] = []

    /// - Parameters:
    ///   - executable: path of the `specstream-mlx` console script (e.g. inside a venv).
    ///   - model: model directory or bundled name.
    ///   - extraArguments: further `serve` flags, e.g. `["--mode", "ss"]`.
    public init(executable: URL, model: String, extraArguments: [String] = []) throws {
        process.executableURL = executable
        process.arguments = ["serve", "--stdio", "--model", model] + extraArguments
        process.standardInput = stdinPipe
        process.standardOutput = stdoutPipe
        process.standardError = stderrPipe
        // A write to a server that died must fail, not kill this process.
        signal(SIGPIPE, SIG_IGN)
        stdoutPipe.fileHandleForReading.readabilityHandler = { [weak self] handle in
            let data = handle.availableData
            if data.isEmpty {
                // EOF: clear the handler, or it is called again and again (a busy loop).
                handle.readabilityHandler = nil
            }
            self?.consume(data)
        }
        // Logs: drain so the child never blocks on a full pipe.
        stderrPipe.fileHandleForReading.readabilityHandler = { handle in
            let data = handle.availableData
            if data.isEmpty {
                handle.readabilityHandler = nil
                return
            }
            if let line = String(data: data, encoding: .utf8) {
                FileHandle.standardError.write(Data(("[specstream] " + line).utf8))
            }
        }
        process.terminationHandler = { [weak self] proc in
            self?.failAll(SpecStreamError(code: "server_exited",
                                          message: "the server exited with status \(proc.terminationStatus)"))
        }
        try process.run()
        // The child holds its ends of the pipes now. Foundation on Linux leaves the parent's
        // copies open, and an open write end means the server's exit is never seen as EOF.
        try? stdoutPipe.fileHandleForWriting.close()
        try? stderrPipe.fileHandleForWriting.close()
        try? stdinPipe.fileHandleForReading.close()
    }

    /// Waits for the `ready` event (the model loaded); throws `load_failed` (or
    /// `server_exited`) when the server could not load the model.
    public func waitUntilReady() async throws -> SpecStreamReady {
        try await withCheckedThrowingContinuation { continuation in
            lock.lock()
            if let ready {
                lock.unlock()
                continuation.resume(returning: ready)
            } else if let gone = serverGone {
                lock.unlock()
                continuation.resume(throwing: gone)
            } else {
                readyWaiters.append(continuation)
                lock.unlock()
            }
        }
    }

    /// Starts a request: a `prompt` or chat `messages` (the server applies the chat template
    /// to both). Cancelling the task that consumes `events` cancels the request; so does `cancel(id)`.
    public func start(prompt: String? = nil, messages: [[String: String]]? = nil, maxTokens: Int = 256,
                      temperature: Double = 0, seed: Int? = nil, mode: String? = nil,
                      stop: [String] = []) -> SpecStreamRequest {
        let id = newId()
        var request: [String: Any] = ["id": id, "max_tokens": maxTokens, "temperature": temperature]
        if let prompt { request["prompt"] = prompt }
        if let messages { request["messages"] = messages }
        if let seed { request["seed"] = seed }
        if let mode { request["mode"] = mode }
        if !stop.isEmpty { request["stop"] = stop }
        let events = AsyncStream<SpecStreamEvent> { continuation in
            lock.lock()
            let gone = serverGone
            if gone == nil { continuations[id] = continuation }
            lock.unlock()
            if let gone {  // the server already exited: answer at once instead of hanging
                continuation.yield(.error(code: gone.code, message: gone.message))
                continuation.finish()
                return
            }
            continuation.onTermination = { [weak self] reason in
                if case .cancelled = reason { self?.cancel(id) }
            }
            send(request)
        }
        return SpecStreamRequest(id: id, events: events)
    }

    /// Streams the reply to a chat. Cancelling the consuming task cancels the request.
    public func generate(messages: [[String: String]], maxTokens: Int = 256, temperature: Double = 0,
                         mode: String? = nil, stop: [String] = []) -> AsyncStream<SpecStreamEvent> {
        start(messages: messages, maxTokens: maxTokens, temperature: temperature, mode: mode, stop: stop).events
    }

    /// Asks the server to stop request `id`; its stream still ends with `done` (`cancelled`).
    public func cancel(_ id: String) {
        send(["id": id, "cancel": true])
    }

    /// The server's process id (to watch or signal it).
    public var serverProcessIdentifier: Int32 { process.processIdentifier }

    /// Convenience: the whole reply as a string.
    public func complete(prompt: String, maxTokens: Int = 256, mode: String? = nil) async throws -> String {
        for await event in start(prompt: prompt, maxTokens: maxTokens, mode: mode).events {
            switch event {
            case .token: continue
            case .done(let text, _, _): return text
            case .error(let code, let message): throw SpecStreamError(code: code, message: message)
            }
        }
        throw SpecStreamError(code: "eof", message: "the server exited")
    }

    /// Closes stdin: the server finishes queued requests and exits with code 0.
    public func close() {
        try? stdinPipe.fileHandleForWriting.close()
        process.waitUntilExit()
    }

    private func newId() -> String {
        lock.lock(); defer { lock.unlock() }
        nextId += 1
        return "swift-\(nextId)"
    }

    private func send(_ request: [String: Any]) {
        guard var data = try? JSONSerialization.data(withJSONObject: request) else { return }
        data.append(0x0A)
        do {
            try stdinPipe.fileHandleForWriting.write(contentsOf: data)
        } catch {
            failAll(SpecStreamError(code: "server_exited", message: "cannot write to the server: \(error)"))
        }
    }

    /// Ends every open request with `error` and makes later requests fail at once.
    private func failAll(_ error: SpecStreamError) {
        lock.lock()
        if serverGone == nil { serverGone = error }
        let open = continuations
        continuations = [:]
        let waiters = readyWaiters
        readyWaiters = []
        lock.unlock()
        for waiter in waiters { waiter.resume(throwing: error) }
        for continuation in open.values {
            continuation.yield(.error(code: error.code, message: error.message))
            continuation.finish()
        }
    }

    private func consume(_ chunk: Data) {
        if chunk.isEmpty {  // EOF: the server is gone; finish every open stream with an error
            failAll(SpecStreamError(code: "server_exited", message: "the server closed its output"))
            return
        }
        buffer.append(chunk)
        while let newline = buffer.firstIndex(of: 0x0A) {
            let line = buffer.subdata(in: buffer.startIndex..<newline)
            buffer.removeSubrange(buffer.startIndex...newline)
            handle(line)
        }
    }

    private func handle(_ line: Data) {
        guard let obj = try? JSONSerialization.jsonObject(with: line) as? [String: Any],
              let event = obj["event"] as? String else { return }
        if event == "error", obj["code"] as? String == "load_failed" {  // the model did not load
            failAll(SpecStreamError(code: "load_failed", message: obj["message"] as? String ?? ""))
            return
        }
        if event == "ready" {
            let info = SpecStreamReady(model: obj["model"] as? String ?? "", modes: obj["modes"] as? [String] ?? [],
                                       maxContext: obj["max_context"] as? Int ?? 0)
            lock.lock()
            ready = info
            let waiters = readyWaiters
            readyWaiters = []
            lock.unlock()
            for waiter in waiters { waiter.resume(returning: info) }
            return
        }
        let id = (obj["id"] as? String) ?? (obj["id"] as? Int).map(String.init) ?? ""
        lock.lock(); let continuation = continuations[id]; lock.unlock()
        guard let continuation else { return }
        switch event {
        case "token":
            continuation.yield(.token(obj["text"] as? String ?? ""))
        case "done":
            let stats = (obj["stats"] as? [String: Any] ?? [:]).compactMapValues { $0 as? Double }
            continuation.yield(.done(text: obj["text"] as? String ?? "",
                                     finishReason: obj["finish_reason"] as? String ?? "",
                                     stats: stats))
            finish(id)
        case "error":
            continuation.yield(.error(code: obj["code"] as? String ?? "", message: obj["message"] as? String ?? ""))
            finish(id)
        default:
            break
        }
    }

    private func finish(_ id: String) {
        lock.lock(); let c = continuations.removeValue(forKey: id); lock.unlock()
        c?.finish()
    }
}
