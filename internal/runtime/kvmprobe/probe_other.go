//go:build !linux

package kvmprobe

import "context"

// observe: KVM is Linux-only, so every other OS uses tcg.
func observe(ctx context.Context, opts Options) Facts {
	f := Facts{DevPath: opts.DevPath, DevErr: "KVM is Linux-only"}
	checkPVM(ctx, opts, &f)
	return f
}
