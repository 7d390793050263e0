"""smolagents' E2B executor (CodeAgent(executor_type="e2b")) against the gateway.

The model is scripted (a smolagents Model returning fixed code, no LLM). The
executor sends `!pip install pillow numpy` (the requirements smolagents reads
off its patched final_answer tool) before the agent's code: it must not be a
SyntaxError, and the agent must reach its final answer and kill its sandbox.
"""

from e2b import Sandbox, SandboxQuery
from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model

# smolagents defines its final_answer tool in the sandbox with `import numpy`
# and `import PIL` at the top: without them no agent runs. Its default
# template, code-interpreter-v1 (root/code-interpreter), has them.

STEPS = [
    "Thought: compute it in the sandbox.\n<code>\nimport os\n!echo from-shell\nx = 6 * 7\nprint('x is', x)\n</code>",
    "Thought: done.\n<code>\nfinal_answer(x)\n</code>",
]


class ScriptedModel(Model):
    def __init__(self, steps):
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.calls = 0

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        content = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=content)


def _mine(test_id):
    return Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id})).next_items()


def test_smolagents_code_agent_e2b(test_id):
    model = ScriptedModel(STEPS)
    sent = []
    with CodeAgent(tools=[], model=model, executor_type="e2b",
                   executor_kwargs={"metadata": {"sandbox_test_id": test_id}}, max_steps=4) as agent:
        ex = agent.python_executor
        run_code = ex.sandbox.run_code

        def spy(code, *a, **kw):
            sent.append(code)
            return run_code(code, *a, **kw)

        ex.sandbox.run_code = spy
        assert [s.sandbox_id for s in _mine(test_id)] == [ex.sandbox.sandbox_id]
        answer = agent.run("What is 6 times 7?")
        steps = agent.memory.steps
    assert answer == 42
    assert model.calls == 2
    assert any("from-shell" in (getattr(s, "observations", "") or "") for s in steps)
    assert _mine(test_id) == [], "the agent left its sandbox behind"
    # What smolagents really sends first: IPython's shell escape for pip.
    assert sent and any(c.startswith("!pip install") for c in sent), sent
