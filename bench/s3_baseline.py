"""The baseline of `strata bench ckpt --store`: boto3's transfer manager moving the same file to
and from the same store, with the same part size and concurrency.

    s3_baseline.py --file PATH --url s3://bucket/key --part-bytes N --concurrency N

Endpoint, region and credentials come from the AWS_* variables as for Strata. Prints one JSON
line: {"upload_s", "download_s", "bytes"}; the object is deleted afterwards.
"""
import argparse
import io
import json
import os
import time

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

p = argparse.ArgumentParser()
p.add_argument("--file", required=True)
p.add_argument("--url", required=True)
p.add_argument("--part-bytes", type=int, required=True)
p.add_argument("--concurrency", type=int, required=True)
a = p.parse_args()
bucket, key = a.url[len("s3://"):].split("/", 1)
# Path-style off AWS, as Strata's driver; checksums only when required (RGW 16 refuses the
# aws-chunked trailer botocore sends by default).
endpoint = os.environ.get("AWS_ENDPOINT_URL")
style = "virtual" if not endpoint or endpoint.endswith("amazonaws.com") else "path"
s3 = boto3.client("s3", endpoint_url=endpoint,
                  config=Config(s3={"addressing_style": style}, request_checksum_calculation="when_required",
                                response_checksum_validation="when_required",
                                max_pool_connections=max(10, a.concurrency)))
cfg = TransferConfig(multipart_threshold=a.part_bytes, multipart_chunksize=a.part_bytes,
                     max_concurrency=a.concurrency, use_threads=True)
size = os.path.getsize(a.file)
t0 = time.perf_counter()
s3.upload_file(a.file, bucket, key, Config=cfg)
up = time.perf_counter() - t0
buf = io.BytesIO()
t0 = time.perf_counter()
s3.download_fileobj(bucket, key, buf, Config=cfg)
down = time.perf_counter() - t0
assert buf.getbuffer().nbytes == size
s3.delete_object(Bucket=bucket, Key=key)
print(json.dumps({"upload_s": up, "download_s": down, "bytes": size}))
