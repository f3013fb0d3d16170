"""radixrelay.lang: programs that generate, branch and choose, with prefixes reused by the server.

    import radixrelay.lang as rl

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    rl.set_default_backend(rl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is 2 + 2?")["answer"])

See docs/lang.md.
"""

from radixrelay.lang.runtime_backend import Backend, CallMeta, Usage, set_default_backend
from radixrelay.lang.chat import RoleMarkers
from radixrelay.lang.errors import BackendError, ProgramError
from radixrelay.lang.expr import assistant, assistant_begin, assistant_end, gen, select, system, user
from radixrelay.lang.openai_compat import OpenAICompatible
from radixrelay.lang.program import Program, function
from radixrelay.lang.runtime import Runtime, RuntimeEndpoint
from radixrelay.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend", "BackendError", "CallMeta", "ForkGroup", "OpenAICompatible", "Program", "ProgramError",
    "ProgramState", "RoleMarkers", "Runtime", "RuntimeEndpoint", "Usage", "assistant", "assistant_begin",
    "assistant_end", "function", "gen",
    "select", "set_default_backend", "system", "user",
]
