package kvmprobe

import "runtime"

var isAMD64 = runtime.GOARCH == "amd64"
