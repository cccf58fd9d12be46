"""The gateway actor beside a run's rollout servers (`agent.gateway: true`, as `raytool serve` starts
it): the OpenAI API over the LLM manager and a trajectory URL recorded through it; `agent_name:
openai` rows on the agent workers; `raytool serve` itself."""

from pathlib import Path

import openai
import pytest

from helpers.net import free_port
from raytool.config import load_config

pytestmark = pytest.mark.integration


def test_the_gateway_actor_serves_the_policy_and_records_a_trajectory_url(ray_cluster):
    import time

    import ray

    from actors.drivers.compose import build
    from raytool.data.prompts import PromptRow
    from raytool.engines.scripted import SCRIPT
    from raytool.types import Message

    agent = Path(__file__).parents[1] / "helpers" / "openai_agent.py"
    port = free_port()
    cfg = load_config(None, ["model.path=tiny-random", "rollout.engine=scripted", "rollout.scripted_delay_s=0.01", "agent.gateway=true",
                             f"agent.gateway_port={port}",
                             "rollout.num_cpus=0.5", "rollout.max_model_len=2048", "rollout.n=2", "reward.fn=boxed_match",
                             f"agent.openai_agent={agent}:agent"])
    graph = build(cfg, with_trainer=False)
    try:
        assert graph.gateway_url == f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=graph.gateway_url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-random"]
        reply = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "6 * 7 + 1?"}])
        assert reply.choices[0].message.content == SCRIPT[0] and reply.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x " * 3000}])
        assert too_long.value.code == "context_length_exceeded"

        url = ray.get(graph.gateway.open.remote("t0"))
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "6 * 7 + 1?"}]
        for output in ("42", "43", None):
            message = client.chat.completions.create(model="tiny-random", messages=messages).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if output:
                messages.append({"role": "tool", "content": output})
        traj = ray.get(graph.gateway.finish.remote(url, "t0", "g", "43", message.content))
        assert traj.num_turns == 3 and traj.finish_reason == "answer" and traj.messages[-1].content == SCRIPT[2]
        tok = __import__("transformers").AutoTokenizer.from_pretrained(graph.model_path)
        generated = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if m])
        assert all(turn in generated for turn in SCRIPT)
        with pytest.raises(openai.NotFoundError):  # finished
            client.chat.completions.create(model="tiny-random", messages=messages)

        # agent_name: openai rows on the agent workers: the agent's own loop through each worker's gateway, scored
        row = PromptRow(prompt=[Message("user", "6 * 7 + 1?")], ground_truth="43", data_source="t", agent_name="openai")
        stats, refs = graph.rollout([row, row], "oa")
        trajs = [t for ref in refs for t in ray.get(ref.trajectories)]
        assert len(trajs) == 4 and {(t.agent_name, t.num_turns, t.finish_reason, t.reward) for t in trajs} == {("openai", 3, "answer", 1.0)}
        assert all(t.messages[-1].content == SCRIPT[2] and sum(t.response_mask) > 0 for t in trajs)

        # A killed gateway is restarted by Ray and serves again on its fixed port; open trajectories are gone.
        lost = ray.get(graph.gateway.open.remote("t1"))
        ray.kill(graph.gateway, no_restart=False)
        client = openai.OpenAI(base_url=graph.gateway_url + "/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 90
        while True:
            try:
                reply = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "again"}])
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                assert time.monotonic() < deadline, "the gateway did not come back"
                time.sleep(1)
        assert reply.choices[0].message.content == SCRIPT[0]
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=lost, api_key="x", max_retries=0).chat.completions.create(model="tiny-random", messages=messages)
    finally:
        graph.shutdown()


def test_raytool_serve_answers_until_stopped_and_then_leaves_nothing_running(ray_cluster):
    """`raytool serve`'s function, in a thread of this process (the CLI runs it in its main thread)."""
    import threading
    import time

    import ray

    from actors.drivers.serve import serve

    port = free_port()
    cfg = load_config(None, ["model.path=tiny-random", "rollout.engine=scripted", "rollout.scripted_delay_s=0.01", "rollout.num_cpus=0.5",
                             "cluster.namespace=raytool-serve-test"])
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(cfg, "127.0.0.1", port), kwargs={"stop": stop})
    thread.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=5)
    deadline = time.monotonic() + 120
    while True:
        try:
            reply = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "6 * 7?"}])
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline and thread.is_alive(), "raytool serve did not come up"
            time.sleep(1)
    assert reply.choices[0].message.content.startswith("Let me compute it.")
    stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "again"}])
    time.sleep(2)  # ray.kill is asynchronous
    alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "raytool-serve-test"]
    assert alive == [], alive
