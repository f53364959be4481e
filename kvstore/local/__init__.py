"""A private cluster on one machine: `kvstore up` (etcd and nodes as child processes) and the
throwaway certificate authority behind `kvstore up --tls` and `kvstore certs`."""
