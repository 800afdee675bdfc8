/* The C API: a request as JSON text in, the answer as JSON text out. The web page calls it compiled to
 * WebAssembly (web/); any C caller can call it natively. It only turns the request into the library's calls
 * (set_field() for each field, in the table's order as the CLI does, then resolve(), estimate(), fit()) and the
 * result into the report's JSON and SVG text, so its numbers are the CLI's.
 *
 * A request:
 *   {"fields": {"model": "gpt2", "batch": "8", "lora": "r=16", "overrides": ["n_layer=4"]},
 *    "files": {"config.json": "<the text of a config.json>"},        (optional: a model given by path reads it)
 *    "plots": ["breakdown", "timeline"],                                (estimate: the pictures to draw)
 *    "timeline": {"by": "event", "unit": "B", "min_bytes": "1MiB", "step": "2"},  (estimate: the timeline's rows,
 *                                                        as trainmem timeline's flags; each optional)
 *    "fit": {"solve": "batch", "margin": "5%"},                         (fit: its options, as the CLI's flags)
 *    "plan": {"global_batch": "512", "nodes": "8", "top": "10", "margin": "5%"}}  (plan: its options; the fields
 *                                                        name the cluster with "gpus")
 * Field values are the CLI's flag values as text (a JSON number or boolean is taken as its text); a repeatable
 * field (overrides, freeze) takes a list. Field names are scenario_fields()' ("optimizer_impl").
 *
 * An answer: {"ok": true, ...} or {"ok": false, "error": "<the CLI's message>", "field": "<the field, if one>"}.
 *   estimate: "estimate" (trainmem estimate --format json), "table" (its table), "warnings",
 *             "svg": {"breakdown": ..., "timeline": ...} (estimate --plot, timeline --plot),
 *             "timeline" (trainmem timeline --format json, when asked)
 *   fit:      "fit" (trainmem fit --format json), "table" (its table), "warnings"
 *   plan:     "plan" (trainmem plan --format json), "table" (its table), "warnings"
 *
 * Every returned text is NUL-terminated UTF-8 owned by the library, valid until the next call on the same
 * thread. No function throws.
 */
#ifndef TRAINMEM_C_API_H_
#define TRAINMEM_C_API_H_

#ifdef __cplusplus
extern "C" {
#endif

const char* trainmem_estimate_json(const char* request_json);
const char* trainmem_fit_json(const char* request_json);
const char* trainmem_plan_json(const char* request_json);
/* trainmem models / trainmem gpus --format json, wrapped: {"ok": true, "models": [...]} / {"ok": true, "gpus": [...]} */
const char* trainmem_models_json(void);
const char* trainmem_gpus_json(void);
/* The scenario fields a front end can set: {"ok": true, "fields": [{"name", "help", "group", "repeatable",
 * "default"}, ...]} in the table's order; "default" is field_text() of a default Scenario. */
const char* trainmem_fields_json(void);

#ifdef __cplusplus
}
#endif

#endif /* TRAINMEM_C_API_H_ */
