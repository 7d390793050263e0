#!/usr/bin/env python3
"""Time `runc run --detach` of the config.json our node wrote for a live
sandbox against variants of it and against `runc spec`'s default, interleaved,
as root. Every variant runs /bin/sleep from the same plain rootfs directory, so
only the config differs.

  python3 bench/runc-variants/run.py CONFIG_JSON ROOTFS_DIR [ROUNDS]

CONFIG_JSON: <data dir>/node/sandboxes/<id>/config.json of a running sandbox
(the network namespace it names must still exist). ROOTFS_DIR: e.g. a copy of
/var/cache/opendsec/rootfs/busybox. Everything made lives in a temp dir and is
removed; containers are deleted after each run.
"""
import copy, json, os, shutil, statistics, subprocess, sys, tempfile, time

def main():
    src = json.load(open(sys.argv[1]))
    rootfs = os.path.abspath(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    work = tempfile.mkdtemp(prefix="odrunc-variants.")
    root = os.path.join(work, "state")
    try:
        tmpl = os.path.join(work, "tmpl")
        os.makedirs(tmpl)
        subprocess.run(["runc", "spec"], cwd=tmpl, check=True)
        base = json.load(open(os.path.join(tmpl, "config.json")))
        rundir = os.path.join(work, "run")
        os.makedirs(rundir)

        def mk(c):
            c = copy.deepcopy(c)
            c["root"] = {"path": rootfs, "readonly": False}
            c["process"]["args"] = ["/bin/sleep", "1000"]
            c["process"]["terminal"] = False
            return c

        def ours():
            c = mk(src)
            for m in c["mounts"]:
                if m["destination"] == "/run/opendsec":
                    m["source"] = rundir
            return c

        netns = next((n.get("path") for n in src["linux"]["namespaces"] if n["type"] == "network"), None)
        v = {"ours": ours()}
        c = ours(); c["linux"]["namespaces"] = [n for n in c["linux"]["namespaces"] if n["type"] != "cgroup"]; v["ours -cgroupns"] = c
        c = ours(); c["linux"]["maskedPaths"] = []; c["linux"]["readonlyPaths"] = []; v["ours -masked"] = c
        c = ours(); c["mounts"] = [m for m in c["mounts"] if m["type"] != "bind"]; v["ours -binds"] = c
        c = ours(); c["mounts"] = [m for m in c["mounts"] if m["destination"] != "/tmp"]; v["ours -tmp"] = c
        c = ours(); c["linux"].pop("resources", None); v["ours -resources"] = c
        c = ours(); c["linux"]["namespaces"] = [n if n["type"] != "network" else {"type": "network"} for n in c["linux"]["namespaces"]]; v["ours newnetns"] = c
        v["runc spec"] = mk(base)
        if netns:
            b = mk(base); b["linux"]["namespaces"] = [n if n["type"] != "network" else {"type": "network", "path": netns} for n in b["linux"]["namespaces"]]; v["runc spec +joinnet"] = b

        res = {k: [] for k in v}
        for i in range(rounds):
            for k, cfg in v.items():
                bd = os.path.join(work, "b-" + k.replace(" ", "_"))
                os.makedirs(bd, exist_ok=True)
                json.dump(cfg, open(os.path.join(bd, "config.json"), "w"))
                cid = "odrv%d-%d" % (i, list(v).index(k))
                err = os.path.join(work, "err")
                t = time.perf_counter()
                r = subprocess.run(["runc", "--root", root, "run", "--detach", "--bundle", bd, cid],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
                dt = (time.perf_counter() - t) * 1000
                if r.returncode != 0:
                    print(k, open(err).read()[:300], file=sys.stderr)
                    continue
                res[k].append(dt)
                subprocess.run(["runc", "--root", root, "delete", "-f", cid], capture_output=True)
        print("| config | runc run --detach p50 (ms) | n |")
        print("|---|---|---|")
        for k, xs in res.items():
            if xs:
                print("| %s | %.2f | %d |" % (k, statistics.median(xs), len(xs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    main()
