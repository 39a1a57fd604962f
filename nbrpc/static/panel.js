// nbrpc's cluster panel (%rpc_panel): the HTML is computed in Python (nbrpc._views.panel);
// this front end draws it, asks before it sends an action, and shows what the kernel said.
// No imports: clusters are often offline.

const SAY = {
  restart: (t) =>
    `restart ${t}? Its RRefs and its globals (set by %%rpc cells or nbrpc.push) go with ` +
    "its process.",
  stacks: (t) => `show the stacks of ${t || "every process"}?`,
  shutdown: () => "shut the cluster down? Every worker leaves.",
};

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "nbrpc-view nbrpc-panel";
  root.style.overflow = "auto";
  root.style.padding = "6px";
  const body = document.createElement("div");
  const status = document.createElement("div");
  status.className = "nbrpc-panel-status";
  status.style.cssText = "margin-top:8px;font:12px sans-serif;color:#333;white-space:pre-wrap";
  const output = document.createElement("pre");
  output.className = "nbrpc-panel-output";
  output.style.cssText = "font-size:11px;max-height:320px;overflow:auto;background:#f6f6f6";
  root.append(body, status, output);
  el.appendChild(root);

  const say = () => {
    status.textContent = model.get("status");
  };
  const show = () => {
    output.textContent = model.get("output");
    output.style.display = model.get("output") ? "" : "none";
  };

  const ask = (action, target) => {
    // asks first: the action goes to the kernel only after "yes"
    status.innerHTML = "";
    const line = document.createElement("span");
    line.textContent = SAY[action](target) + " ";
    const yes = document.createElement("button");
    yes.className = "nbrpc-confirm-yes";
    yes.textContent = "yes";
    const no = document.createElement("button");
    no.className = "nbrpc-confirm-no";
    no.textContent = "no";
    yes.onclick = () => {
      model.send({ action, target });
      status.textContent =
        `sent: ${action} ${target}`.trim() +
        ". The kernel runs it when it is free: while a cell runs, it reads no widget message.";
    };
    no.onclick = say;
    status.append(line, yes, " ", no);
  };

  const draw = () => {
    body.innerHTML = model.get("html");
    root.dataset.version = String(model.get("version"));
    for (const button of body.querySelectorAll("button[data-action]")) {
      button.onclick = () => ask(button.dataset.action, button.dataset.target || "");
    }
  };

  draw();
  say();
  show();
  model.on("change:html", draw);
  model.on("change:status", say);
  model.on("change:output", show);
  model.set("rendered", true); // the kernel stops waiting to show the card in the cell
  model.save_changes();
  return () => {
    model.off("change:html", draw);
    model.off("change:status", say);
    model.off("change:output", show);
    model.send({ action: "closed", target: "" }); // a closed panel stops asking the workers
  };
}

export default { render };
