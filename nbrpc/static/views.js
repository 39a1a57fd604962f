// nbrpc views: the state (HTML/SVG) is computed in Python by nbrpc._views; this front end
// draws it and adds hover highlighting. No imports: clusters are often offline.

function highlight(root, selector, on) {
  for (const el of root.querySelectorAll(selector)) {
    el.style.opacity = on ? "1" : "";
    el.style.strokeWidth = on ? "3" : "";
  }
}

function wire(root) {
  // Ownership: hovering an RRef box or a worker lane emphasises its holder edges.
  for (const box of root.querySelectorAll("g.rref")) {
    const id = box.dataset.rref;
    const sel = `path.hold-edge[data-rref="${CSS.escape(id)}"]`;
    box.addEventListener("mouseenter", () => highlight(root, sel, true));
    box.addEventListener("mouseleave", () => highlight(root, sel, false));
  }
  // Backward: hovering a send/recv node emphasises the hop it takes part in.
  for (const node of root.querySelectorAll("g.node")) {
    const id = node.dataset.node;
    const sel = `path.rpc-edge[data-src="${CSS.escape(id)}"], path.rpc-edge[data-dst="${CSS.escape(id)}"]`;
    node.addEventListener("mouseenter", () => highlight(root, sel, true));
    node.addEventListener("mouseleave", () => highlight(root, sel, false));
  }
  // Timeline: hovering a call emphasises it and the calls made inside it.
  for (const call of root.querySelectorAll("g.nbrpc-call")) {
    const id = CSS.escape(call.dataset.call);
    const sel = `g.nbrpc-call[data-call="${id}"] rect, g.nbrpc-call[data-parent="${id}"] rect`;
    call.addEventListener("mouseenter", () => highlight(root, sel, true));
    call.addEventListener("mouseleave", () => highlight(root, sel, false));
  }
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "nbrpc-view";
  root.style.overflowX = "auto";
  el.appendChild(root);
  const draw = () => {
    root.innerHTML = model.get("html");
    root.dataset.version = String(model.get("version"));
    wire(root);
  };
  draw();
  model.on("change:html", draw);
  return () => model.off("change:html", draw);
}

export default { render };
