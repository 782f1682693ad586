// Builds the dashboard into ../src/atoll/ui/static (committed): one ES module bundle (app.js),
// one stylesheet (app.css, xterm's included), index.html and the favicon. `make ui` runs it.
import * as esbuild from "esbuild";
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";

const out = new URL("../src/atoll/ui/static/", import.meta.url).pathname;
mkdirSync(out, { recursive: true });
for (const f of readdirSync(out)) rmSync(out + f, { recursive: true });
await esbuild.build({
  entryPoints: { app: "src/main.js" },
  bundle: true,
  format: "esm",
  splitting: true,
  chunkNames: "chunk-[hash]",
  minify: true,
  target: ["es2020"],
  outdir: out,
  legalComments: "linked",
  logLevel: "info",
});
await esbuild.build({
  entryPoints: { app: "src/style.css" },
  bundle: true,
  minify: true,
  legalComments: "external",
  outdir: out,
  logLevel: "info",
});
copyFileSync("src/index.html", out + "index.html");
copyFileSync("src/favicon.svg", out + "favicon.svg");
