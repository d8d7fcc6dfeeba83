// Validates rendered Kubernetes manifests against the Kubernetes OpenAPI
// schemas, offline, with the npm package kubernetes-models (its generated
// JSON-schema validators, one class per apiVersion/kind).
//
//   node k8s_validate.mjs NODE_MODULES_DIR manifests.yaml...
//
// Every document must parse as YAML, carry apiVersion, kind and
// metadata.name, and validate; empty documents (comments only) are skipped.
// Prints one line per object; exits 1 listing every failure.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, ...files] = process.argv.slice(2);
if (!modules || files.length === 0) {
  console.error("usage: node k8s_validate.mjs NODE_MODULES_DIR manifests.yaml...");
  process.exit(2);
}
const require = createRequire(join(modules, "noop.js"));
const YAML = require("yaml");

let failures = 0;
let checked = 0;
for (const file of files) {
  const docs = YAML.parseAllDocuments(readFileSync(file, "utf8"));
  for (const doc of docs) {
    const where = `${file}`;
    if (doc.errors.length > 0) {
      console.log(`FAIL ${where}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      failures++;
      continue;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    const { apiVersion, kind } = obj;
    const name = obj.metadata && obj.metadata.name;
    if (!apiVersion || !kind || !name) {
      console.log(`FAIL ${where}: a document without apiVersion, kind or metadata.name`);
      failures++;
      continue;
    }
    const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
    const path = join(modules, "kubernetes-models", ...(group ? [group, version] : [version]), "index.js");
    let Model;
    try {
      Model = (await import(pathToFileURL(path).href))[kind];
    } catch (e) {
      Model = undefined;
    }
    if (!Model) {
      console.log(`FAIL ${kind}/${name}: no schema for ${apiVersion} ${kind}`);
      failures++;
      continue;
    }
    try {
      new Model(obj).validate();
      console.log(`ok   ${apiVersion} ${kind}/${name}`);
      checked++;
    } catch (e) {
      console.log(`FAIL ${apiVersion} ${kind}/${name}: ${e.message}`);
      failures++;
    }
  }
}
console.log(`${checked} object(s) valid, ${failures} failure(s)`);
process.exit(failures > 0 ? 1 : 0);
