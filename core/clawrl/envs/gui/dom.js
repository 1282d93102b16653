// The page's DOM as MiniWoB's core.getDOMInfo() reports it (same fields), for any page: a local
// OSWorld-style task page as well as a MiniWoB task. Every element keeps a ref (data-clawrl-ref)
// for as long as it lives; text that shares its parent with elements becomes a pseudo-element of
// tag "t" with ref 0 (the screen numbers those after the refs).
var SKIP = {"reward-display": 1, "sync-task-cover": 1, "click-canvas": 1, "query": 1};
if (window.__clawrlNextRef === undefined) window.__clawrlNextRef = 1;
function info(el) {
  if (SKIP[el.id]) return;
  var style = window.getComputedStyle(el);
  if (style.display === "none" || style.visibility === "hidden") return;
  var r = el.getBoundingClientRect();
  if (r.width == 0 || r.height == 0) return;
  if (el.dataset.clawrlRef === undefined) el.dataset.clawrlRef = window.__clawrlNextRef++;
  var a = {tag: el.tagName, left: r.left, top: r.top, width: r.width, height: r.height, children: [],
           id: el.id || "", classes: typeof el.className === "string" ? el.className : "",
           ref: +el.dataset.clawrlRef, bgColor: style.backgroundColor};
  if (el instanceof HTMLInputElement) {
    a.tag += "_" + el.type;
    a.value = (el.type === "checkbox" || el.type === "radio") ? el.checked : el.value;
  } else if (el instanceof HTMLTextAreaElement || el instanceof HTMLSelectElement) {
    a.value = el.value;
  }
  var kids = [], textOnly = true;
  el.childNodes.forEach(function (c) {
    if (c instanceof Text) { if (!/^\s*$/.test(c.data)) kids.push(c); }
    else if (c instanceof Element) { kids.push(c); textOnly = false; }
  });
  if (textOnly) {
    a.text = kids.map(function (x) { return x.data.trim(); }).join(" ");
  } else {
    kids.forEach(function (c) {
      if (c instanceof Text) {
        var range = document.createRange(); range.selectNodeContents(c);
        var b = range.getBoundingClientRect();
        if (b.width > 0 && b.height > 0)
          a.children.push({tag: "t", left: b.left, top: b.top, width: b.width, height: b.height, children: [],
                           id: "", classes: "", ref: 0, text: c.data.trim()});
      } else {
        var k = info(c); if (k !== undefined) a.children.push(k);
      }
    });
  }
  return a;
}
return info(document.body);
