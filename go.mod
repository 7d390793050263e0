module github.com/kernflux/opendsec

go 1.26

require (
	connectrpc.com/connect v1.19.1 // indirect
	google.golang.org/protobuf v1.36.10 // indirect
)
