import Foundation
import SpecStreamClient

// Usage: specstream-demo /path/to/.venv/bin/specstream-mlx MODEL "prompt"
let args = CommandLine.arguments
guard args.count >= 4 else {
    FileHandle.standardError.write(Data("usage: specstream-demo SPECSTREAM_MLX MODEL PROMPT\n".utf8))
    exit(2)
}
let client = try SpecStreamClient(executable: URL(fileURLWithPath: args[1]), model: args[2])
for await event in client.generate(messages: [["role": "user", "content": args[3]]], maxTokens: 128) {
    switch event {
    case .token(let text):
        print(text, terminator: "")
        fflush(stdout)
    case .done(_, let reason, let stats):
        print("\n[\(reason)] \(Int(stats["generated_tokens"] ?? 0)) tokens, τ \(stats["tokens_per_pass"] ?? 0)")
    case .error(let code, let message):
        print("\nerror \(code): \(message)")
    }
}
client.close()
