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
    }

    /// Streams the reply to a chat. Cancelling the consuming task cancels the request.
    public func generate(messages: [[String: String]], maxTokens: Int = 256, temperature: Double = 0,
                         mode: String? = nil, stop: [String] = []) -> AsyncStream<SpecStreamEvent> {
        let id = newId()
        var request: [String: Any] = ["id": id, "messages": messages, "max_tokens": maxTokens,
                                      "temperature": temperature]
        if let mode { request["mode"] = mode }
        if !stop.isEmpty { request["stop"] = stop }
        return AsyncStream { continuation in
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
                if case .cancelled = reason { self?.send(["id": id, "cancel": true]) }
            }
            send(request)
        }
    }

    /// Convenience: the whole reply as a string.
    public func complete(prompt: String, maxTokens: Int = 256) async throws -> String {
        for await event in generate(messages: [["role": "user", "content": prompt]], maxTokens: maxTokens) {
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
        lock.unlock()
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
