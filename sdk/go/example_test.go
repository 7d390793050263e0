package opendsec_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// The quickstart: create a Python sandbox, run a line of Python, stop it.
// Endpoint and token come from OPENDSEC_ENDPOINT and OPENDSEC_TOKEN.
func Example() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{
		Backend:        os.Getenv("OPENDSEC_BACKEND"),
		Image:          "root/py:3.11",
		TimeoutSeconds: 300,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.StopSandbox(context.WithoutCancel(ctx), sb.Id)

	res, err := c.RunShell(ctx, sb.Id, "python3 -c 'print(6*7)'")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(res.Stdout) // 42
}

// Stream a process's output as it is produced and feed it stdin.
func ExampleClient_Exec() {
	ctx := context.Background()
	c, err := opendsec.New("127.0.0.1:7070", opendsec.WithToken("TOKEN"))
	if err != nil {
		log.Fatal(err)
	}
	p, err := c.Exec(ctx, "n001sb0001", opendsec.ExecOptions{
		Command: []string{"python3", "-u", "-c", "import sys; print(sys.stdin.read().upper())"},
		Stdin:   true,
		Timeout: time.Minute,
		Stdout:  os.Stdout,
		OnStderr: func(b []byte) {
			log.Printf("stderr: %s", b)
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = p.SendStdin([]byte("hello"))
	_ = p.CloseStdin()
	st, err := p.Wait()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("exit code", st.ExitCode)
}

// Copy a file in and out of a sandbox.
func ExampleClient_WriteFile() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	data := "print('hi')\n"
	if _, err := c.WriteFile(ctx, "n001sb0001", "/tmp/hi.py", strings.NewReader(data), int64(len(data))); err != nil {
		log.Fatal(err)
	}
	var back bytes.Buffer
	if _, err := c.ReadFile(ctx, "n001sb0001", "/tmp/hi.py", &back); err != nil {
		log.Fatal(err)
	}
}

// Make many sandboxes in one call; each item succeeds or fails on its own.
func ExampleClient_BatchCreate() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	err = c.BatchCreate(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TaskId: "rollout-7"}, 100, func(r opendsec.BatchResult) {
		if r.Err != nil {
			log.Printf("sandbox %d: %v", r.Index, r.Err)
			return
		}
		fmt.Println(r.Sandbox.Id)
	})
	if opendsec.IsUnauthenticated(err) {
		log.Fatal("set OPENDSEC_TOKEN")
	}
}

// Make a sandbox from scratch, bypassing the node's warm pool (to measure
// the cold path), with a caller-chosen idempotency key.
func ExampleClient_CreateSandboxWith() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	sb, err := c.CreateSandboxWith(ctx, &opendsec.SandboxSpec{Image: "root/busybox"},
		opendsec.CreateOptions{RequestID: "bench-cold-1", SkipWarmPool: true})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(sb.Id, "from warm pool:", sb.GetFromWarmPool())
}

// Make a batch of sandboxes from scratch, bypassing the node's warm pool.
func ExampleClient_BatchCreateWith() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	err = c.BatchCreateWith(ctx, &opendsec.SandboxSpec{Image: "root/busybox"}, 10,
		opendsec.CreateOptions{SkipWarmPool: true}, func(r opendsec.BatchResult) {
			if r.Err != nil {
				log.Printf("sandbox %d: %v", r.Index, r.Err)
				return
			}
			fmt.Println(r.Sandbox.Id, "from warm pool:", r.Sandbox.GetFromWarmPool())
		})
	if err != nil {
		log.Fatal(err)
	}
}

// Fork a sandbox that wrote a file into 4 and read the file in each. On
// containers the forks have the files, not the memory (MemoryPreserved is
// false): their processes start again.
func ExampleClient_ForkSandbox() {
	ctx := context.Background()
	c, err := opendsec.New("")
	if err != nil {
		log.Fatal(err)
	}
	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox"})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := c.RunShell(ctx, sb.Id, "echo 42 > ~/answer.txt"); err != nil {
		log.Fatal(err)
	}
	out, err := c.ForkSandbox(ctx, sb.Id, 4, opendsec.ForkOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("source frozen for", out.SourceFrozen)
	for _, f := range out.Forks {
		r, err := c.RunShell(ctx, f.Sandbox.Id, "cat ~/answer.txt")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(f.Sandbox.Id, f.Sandbox.GetParentId(), f.MemoryPreserved, r.Stdout)
	}
}
