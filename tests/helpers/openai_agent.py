"""An agent written against the OpenAI API, for tests that run `agent_name: openai` rows on Ray
with the scripted engine: it answers the model's code cells with their known outputs (the script's
42, then 43) as tool messages, until the model gives its answer."""

OUTPUTS = ["42", "43"]


async def agent(client, row):
    messages = list(row["messages"])
    for output in [*OUTPUTS, None]:
        reply = await client.chat.completions.create(model=row["model"], messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if output is None or "<code>" not in (message.content or ""):
            return message.content or ""
        messages.append({"role": "tool", "content": output})
    return ""
