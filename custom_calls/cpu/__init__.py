"""lrjax.custom_calls.cpu"""
